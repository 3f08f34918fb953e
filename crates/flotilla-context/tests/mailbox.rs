//! Mailboxes against a real nats-server: at-least-once delivery across a reader crash,
//! broadcasts, event-driven wake-up, counted overflow, gapless numbering, malformed posts,
//! exec-style persisted positions and bad input.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{clients, server, server_with, task, task_scope};
use flotilla_bus::JetStreamOptions;
use flotilla_context::Scope;
use flotilla_model::ids::{AttemptId, RunId, TaskId};
use flotilla_model::mailbox::{MailboxKind, MailboxPost};
use serde_json::json;

const NOW: Duration = Duration::ZERO;

#[tokio::test]
async fn a_crashed_readers_messages_are_read_again_until_committed() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let sender = task(&bus, run, "lead")?;
    for i in 0..3 {
        sender
            .mailbox()
            .send("analyst", MailboxKind::Info, json!({ "i": i }), None)
            .await?;
    }
    // Attempt 1 reads the three messages, then "crashes": it never commits.
    let first = task(&bus, run, "analyst")?;
    let page = first.mailbox().receive(None, NOW).await?;
    assert_eq!(page.messages.len(), 3);
    assert_eq!(page.messages[0].payload["i"], 0);
    assert_eq!(page.messages[0].from, "lead");
    assert_eq!(page.messages[0].n, 1);
    // Its handles share the read position: nothing more for the same attempt.
    assert!(
        first
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .is_empty()
    );
    drop(first);
    // Attempt 2 starts from the committed cursor and sees them again.
    let second = task(&bus, run, "analyst")?;
    let again = second.mailbox().receive(Some(2), NOW).await?;
    assert_eq!(again.messages.len(), 2);
    assert!(again.more);
    let rest = second.mailbox().receive(None, NOW).await?;
    assert_eq!(rest.messages.len(), 1);
    let committed = second.mailbox().commit().await?.expect("something read");
    assert_eq!(committed, rest.next_since_seq);
    // After the commit they are gone for the next attempt; new mail still arrives.
    let third = task(&bus, run, "analyst")?;
    assert!(
        third
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .is_empty()
    );
    assert_eq!(
        third.mailbox().commit().await?,
        Some(committed),
        "nothing new to commit"
    );
    sender
        .mailbox()
        .send("analyst", MailboxKind::Info, json!({"i": 3}), None)
        .await?;
    let page = third.mailbox().receive(None, NOW).await?;
    assert_eq!(page.messages.len(), 1);
    assert_eq!(page.messages[0].n, 4);
    // The cursor never moves backwards: an older handle's commit does not undo it.
    third.mailbox().commit().await?;
    let stale = task(&bus, run, "analyst")?;
    stale.mailbox().read_after(0, None).await?; // peeking moves nothing
    assert_eq!(stale.mailbox().commit().await?, None, "nothing read");
    assert_eq!(stale.mailbox().committed().await?, page.next_since_seq);
    Ok(())
}

#[tokio::test]
async fn a_broadcast_reaches_every_reader_but_its_sender() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let a = task(&bus, run, "a")?;
    let b = task(&bus, run, "b")?;
    let c = task(&bus, run, "c")?;
    let sent = a
        .mailbox()
        .send("*", MailboxKind::Info, json!("hello all"), None)
        .await?;
    a.mailbox()
        .send("b", MailboxKind::Request, json!("just b"), Some("c1"))
        .await?;
    let for_b = b.mailbox().receive(None, NOW).await?;
    assert_eq!(for_b.messages.len(), 2);
    assert_eq!(for_b.messages[0].to, "*");
    assert_eq!(for_b.messages[0].seq, sent.seq);
    assert_eq!(for_b.messages[1].correlation_id.as_deref(), Some("c1"));
    let for_c = c.mailbox().receive(None, NOW).await?;
    assert_eq!(for_c.messages.len(), 1);
    assert_eq!(for_c.messages[0].payload, "hello all");
    let for_a = a.mailbox().receive(None, NOW).await?;
    assert!(for_a.messages.is_empty(), "not its own broadcast");
    assert_eq!(for_a.skipped, 0, "its own broadcast is not malformed");
    let stats = a.mailbox().stats(Some("*")).await?;
    assert_eq!((stats.mailbox.as_str(), stats.sent), ("*", 1));
    Ok(())
}

#[tokio::test]
async fn receive_wakes_when_a_message_arrives() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let reader = task(&bus, run, "waiter")?;
    let sender = task(&bus, run, "lead")?;
    // Nothing arrives: the wait runs out and the page is empty.
    let started = Instant::now();
    let page = reader
        .mailbox()
        .receive(None, Duration::from_millis(300))
        .await?;
    assert!(page.messages.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(300));
    // A send 200 ms into a 20 s wait wakes the reader at once.
    let waiting = tokio::spawn({
        let mailbox = reader.mailbox();
        async move {
            let started = Instant::now();
            let page = mailbox.receive(None, Duration::from_secs(20)).await;
            (page, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    sender
        .mailbox()
        .send("waiter", MailboxKind::Accept, json!({"ok": true}), None)
        .await?;
    let (page, waited) = waiting.await?;
    let page = page?;
    assert_eq!(page.messages.len(), 1);
    assert_eq!(page.messages[0].kind, MailboxKind::Accept);
    assert!(
        waited < Duration::from_secs(5),
        "woken by the send, not by the end of the wait: {waited:?}"
    );
    // A broadcast wakes too.
    let waiting = tokio::spawn({
        let mailbox = reader.mailbox();
        async move { mailbox.receive(None, Duration::from_secs(20)).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    sender
        .mailbox()
        .send("*", MailboxKind::Info, json!("all"), None)
        .await?;
    let page = tokio::time::timeout(Duration::from_secs(5), waiting).await???;
    assert_eq!(page.messages.len(), 1);
    Ok(())
}

#[tokio::test]
async fn overflow_of_the_cap_is_counted_exactly() -> anyhow::Result<()> {
    let opts = JetStreamOptions {
        mailbox_max_per_sender: 5,
        ..JetStreamOptions::default()
    };
    let (_server, bus) = server_with(&opts).await?;
    let run = RunId::new();
    let flood = task(&bus, run, "flood")?;
    let quiet = task(&bus, run, "quiet")?;
    let reader = task(&bus, run, "inbox")?;
    for i in 0..12 {
        let sent = flood
            .mailbox()
            .send("inbox", MailboxKind::Info, json!(i), None)
            .await?;
        assert_eq!(sent.n, i + 1);
    }
    for i in 0..2 {
        quiet
            .mailbox()
            .send("inbox", MailboxKind::Info, json!(i), None)
            .await?;
    }
    let stats = reader.mailbox().stats(None).await?;
    assert_eq!(stats.mailbox, "inbox");
    let by: Vec<(&str, u64, u64, u64)> = stats
        .senders
        .iter()
        .map(|s| (s.from.as_str(), s.sent, s.retained, s.dropped))
        .collect();
    assert_eq!(by, vec![("flood", 12, 5, 7), ("quiet", 2, 2, 0)]);
    assert_eq!((stats.sent, stats.retained, stats.dropped), (14, 7, 7));
    assert_eq!((stats.committed, stats.unread), (0, 7));
    // The survivors are the newest, numbered 8..=12: the gap shows what was lost.
    let page = reader.mailbox().receive(None, NOW).await?;
    let ns: Vec<u64> = page
        .messages
        .iter()
        .filter(|m| m.from == "flood")
        .map(|m| m.n)
        .collect();
    assert_eq!(ns, vec![8, 9, 10, 11, 12]);
    reader.mailbox().commit().await?;
    let stats = reader.mailbox().stats(None).await?;
    assert_eq!((stats.committed, stats.unread), (page.next_since_seq, 0));
    Ok(())
}

#[tokio::test]
async fn numbering_has_no_gaps_under_concurrent_senders() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    // Several handles of one sender and three senders, all sending to one reader at once.
    let mut sends = Vec::new();
    for sender in ["s1", "s2", "s3"] {
        let c = task(&bus, run, sender)?;
        for i in 0..15 {
            let mailbox = c.mailbox();
            sends.push(tokio::spawn(async move {
                mailbox
                    .send("target", MailboxKind::Info, json!({ "i": i }), None)
                    .await
                    .map(|s| (s, mailbox.address().map(str::to_owned)))
            }));
        }
    }
    let mut numbers: std::collections::BTreeMap<String, BTreeSet<u64>> = Default::default();
    for s in sends {
        let (sent, from) = s.await??;
        assert!(!sent.duplicate);
        numbers.entry(from?).or_default().insert(sent.n);
    }
    for (from, ns) in &numbers {
        assert_eq!(ns, &(1..=15).collect::<BTreeSet<u64>>(), "{from}");
    }
    // The stored posts agree.
    let reader = task(&bus, run, "target")?;
    let page = reader.mailbox().receive(None, NOW).await?;
    assert_eq!(page.messages.len(), 45);
    for from in ["s1", "s2", "s3"] {
        let ns: Vec<u64> = page
            .messages
            .iter()
            .filter(|m| m.from == from)
            .map(|m| m.n)
            .collect();
        assert_eq!(ns, (1..=15).collect::<Vec<_>>(), "in stream order, {from}");
    }
    Ok(())
}

#[tokio::test]
async fn sends_are_idempotent_per_attempt() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let scope = task_scope(&bus, run, "lead");
    let first = clients(&bus, scope.clone())?;
    let a = first
        .mailbox()
        .send("b", MailboxKind::Request, json!({"x": 1}), Some("c"))
        .await?;
    // The redelivered attempt repeats the send: not stored again, same number.
    let redelivered = clients(
        &bus,
        Scope {
            delivery: Some(2),
            ..scope.clone()
        },
    )?;
    let again = redelivered
        .mailbox()
        .send("b", MailboxKind::Request, json!({"x": 1}), Some("c"))
        .await?;
    assert!(again.duplicate);
    assert_eq!((again.seq, again.n), (a.seq, a.n));
    // Another correlation id is another message.
    let other = redelivered
        .mailbox()
        .send("b", MailboxKind::Request, json!({"x": 1}), Some("d"))
        .await?;
    assert_eq!((other.duplicate, other.n), (false, 2));
    Ok(())
}

#[tokio::test]
async fn malformed_posts_are_skipped_and_the_reader_keeps_going() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let a = task(&bus, run, "a")?;
    let b = task(&bus, run, "b")?;
    a.mailbox()
        .send("b", MailboxKind::Info, json!(1), None)
        .await?;
    let names = bus.names();
    let js = bus.js();
    js.publish(names.mailbox(run, "b", "a"), Bytes::from_static(b"garbage"))
        .await?
        .await?;
    // A well-formed post whose body claims another sender than its subject.
    let forged = MailboxPost {
        protocol: 1,
        kind: MailboxKind::Info,
        from: "boss".into(),
        to: "b".into(),
        payload: json!("trust me"),
        correlation_id: None,
        n: 0,
        sender: None,
    };
    js.publish(
        names.mailbox(run, "b", "a"),
        serde_json::to_vec(&forged)?.into(),
    )
    .await?
    .await?;
    js.publish(names.mailbox(run, "_all", "a"), Bytes::from_static(b"{}"))
        .await?
        .await?;
    // After the malformed last post, numbering restarts (the post itself is still sent).
    a.mailbox()
        .send("b", MailboxKind::Info, json!(2), None)
        .await?;
    let page = b.mailbox().receive(None, NOW).await?;
    let payloads: Vec<_> = page.messages.iter().map(|m| m.payload.clone()).collect();
    assert_eq!(payloads, vec![json!(1), json!(2)]);
    assert_eq!(page.skipped, 3);
    assert!(b.mailbox().receive(None, NOW).await?.messages.is_empty());
    Ok(())
}

#[tokio::test]
async fn an_exec_agents_processes_share_one_persisted_position() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let lead = task(&bus, run, "lead")?;
    let scope = task_scope(&bus, run, "worker_task");
    for i in 0..2 {
        lead.mailbox()
            .send("worker_task", MailboxKind::Info, json!(i), None)
            .await?;
    }
    // Each `flotilla mbox read` inside the agent is a new process with the same scope.
    let process = || clients(&bus, scope.clone()).map(|c| c.persist_read_position(true));
    assert_eq!(
        process()?
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .len(),
        2
    );
    assert!(
        process()?
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .is_empty()
    );
    lead.mailbox()
        .send("worker_task", MailboxKind::Info, json!(2), None)
        .await?;
    let page = process()?.mailbox().receive(None, NOW).await?;
    assert_eq!(page.messages.len(), 1);
    // Nothing is committed until the worker takes the position over and commits it.
    let worker_side = clients(&bus, scope.clone())?;
    assert_eq!(worker_side.mailbox().committed().await?, 0);
    worker_side.mailbox().adopt_execution_position().await?;
    assert_eq!(
        worker_side.mailbox().commit().await?,
        Some(page.next_since_seq)
    );
    // The next attempt starts after it.
    let next_attempt = clients(
        &bus,
        Scope {
            attempt: Some(2),
            attempt_id: Some(AttemptId::new()),
            ..scope.clone()
        },
    )?
    .persist_read_position(true);
    assert!(
        next_attempt
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .is_empty()
    );
    // A redelivery of the failed attempt 1 (delivery 2) would start from the commit too:
    // positions are per execution.
    let redelivery = clients(
        &bus,
        Scope {
            delivery: Some(2),
            ..scope
        },
    )?
    .persist_read_position(true);
    assert!(
        redelivery
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .is_empty()
    );
    Ok(())
}

#[tokio::test]
async fn bad_addresses_oversize_payloads_and_missing_identity_are_refused() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let a = task(&bus, run, "a")?;
    for bad in ["a.b", "x*", ">", "", "two words", "_all", "_hidden"] {
        let err = a
            .mailbox()
            .send(bad, MailboxKind::Info, json!(null), None)
            .await
            .expect_err(bad);
        assert_eq!(err.code(), "invalid_address", "{bad}");
    }
    let big = json!("x".repeat(1024 * 1024));
    let err = a
        .mailbox()
        .send("b", MailboxKind::Info, big, None)
        .await
        .expect_err("too large");
    assert_eq!(err.code(), "payload_too_large");
    assert!(err.to_string().contains("bytes"), "{err}");
    let operator = clients(
        &bus,
        Scope::operator(bus.names().clone(), run, run, run.to_string()),
    )?;
    let err = operator
        .mailbox()
        .receive(None, NOW)
        .await
        .expect_err("no task");
    assert_eq!(err.code(), "invalid_scope");
    // An operator acting as a task reads its mailbox (and sends as it).
    let as_b = clients(
        &bus,
        Scope::operator(bus.names().clone(), run, run, run.to_string()).with_task(TaskId::new("b")),
    )?;
    as_b.mailbox()
        .send("a", MailboxKind::Info, json!("from the operator"), None)
        .await?;
    let page = a.mailbox().receive(None, NOW).await?;
    assert_eq!(page.messages[0].from, "b");
    assert_eq!(
        page.messages[0]
            .sender
            .as_ref()
            .and_then(|s| s.by.as_deref()),
        Some("operator")
    );
    // Nothing bad was stored.
    let stream = bus.js().get_stream("FLOTILLA_MAILBOX").await?;
    let info = stream.get_info().await?;
    assert_eq!(info.state.messages, 1);
    Ok(())
}

/// Clients of a fresh attempt of `task`, which plays `role`.
fn playing(
    bus: &flotilla_bus::Bus,
    run: RunId,
    task: &str,
    role: &str,
) -> anyhow::Result<flotilla_context::Clients> {
    clients(bus, task_scope(bus, run, task).with_role(role))
}

#[tokio::test]
async fn a_message_to_a_role_is_read_by_exactly_one_task_playing_it() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let lead = task(&bus, run, "lead")?;
    let sent: BTreeSet<u64> = {
        let mut seqs = BTreeSet::new();
        for i in 0..20 {
            let s = lead
                .mailbox()
                .send(
                    "role:analyst",
                    MailboxKind::Request,
                    json!({ "i": i }),
                    None,
                )
                .await?;
            seqs.insert(s.seq);
        }
        seqs
    };
    // Two tasks play the role and read at the same time, in small pages; a third plays
    // another role, a fourth none.
    let (a, b) = (
        playing(&bus, run, "north", "analyst")?,
        playing(&bus, run, "south", "analyst")?,
    );
    let read_all = |c: flotilla_context::Clients| async move {
        let mut got = Vec::new();
        loop {
            let page = c.mailbox().receive(Some(3), NOW).await?;
            got.extend(page.messages);
            if !page.more {
                break;
            }
        }
        c.mailbox().commit().await?;
        Ok::<_, anyhow::Error>(got)
    };
    let (got_a, got_b) = tokio::try_join!(read_all(a), read_all(b))?;
    let seqs_a: BTreeSet<u64> = got_a.iter().map(|m| m.seq).collect();
    let seqs_b: BTreeSet<u64> = got_b.iter().map(|m| m.seq).collect();
    assert!(seqs_a.is_disjoint(&seqs_b), "{seqs_a:?} / {seqs_b:?}");
    assert_eq!(
        seqs_a.union(&seqs_b).copied().collect::<BTreeSet<_>>(),
        sent,
        "every message reached one of them"
    );
    assert!(
        got_a
            .iter()
            .chain(&got_b)
            .all(|m| m.to == "role:analyst" && m.from == "lead")
    );
    for other in [
        playing(&bus, run, "critic", "reviewer")?,
        task(&bus, run, "bystander")?,
    ] {
        assert!(
            other
                .mailbox()
                .receive(None, NOW)
                .await?
                .messages
                .is_empty()
        );
    }

    // A retried attempt of a reader that did not commit reads its own claims again; the
    // other reader never sees them.
    lead.mailbox()
        .send("role:analyst", MailboxKind::Info, json!("late"), None)
        .await?;
    let first = playing(&bus, run, "north", "analyst")?;
    let page = first.mailbox().receive(None, NOW).await?;
    assert_eq!(page.messages.len(), 1, "{page:?}");
    drop(first);
    let south = playing(&bus, run, "south", "analyst")?;
    assert!(
        south
            .mailbox()
            .receive(None, NOW)
            .await?
            .messages
            .is_empty()
    );
    let retry = playing(&bus, run, "north", "analyst")?;
    let again = retry.mailbox().receive(None, NOW).await?;
    assert_eq!(again.messages.len(), 1);
    assert_eq!(again.messages[0].payload, json!("late"));
    Ok(())
}

#[tokio::test]
async fn a_waiting_member_of_a_role_wakes_on_a_message_to_the_role() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let reader = playing(&bus, run, "north", "analyst")?;
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let page = reader
            .mailbox()
            .receive(None, Duration::from_secs(20))
            .await?;
        Ok::<_, anyhow::Error>((page, started.elapsed()))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    task(&bus, run, "lead")?
        .mailbox()
        .send("role:analyst", MailboxKind::Info, json!("wake"), None)
        .await?;
    let (page, took) = waiting.await??;
    assert_eq!(page.messages.len(), 1);
    assert!(
        took < Duration::from_secs(10),
        "woken, not timed out: {took:?}"
    );
    Ok(())
}

#[tokio::test]
async fn bad_role_addresses_are_refused() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let lead = task(&bus, RunId::new(), "lead")?;
    for to in ["role:", "role:two words", "role:a.b"] {
        let e = lead
            .mailbox()
            .send(to, MailboxKind::Info, json!(1), None)
            .await
            .expect_err(to);
        assert_eq!(
            e.kind(),
            flotilla_context::ErrorKind::InvalidAddress,
            "{to}: {e}"
        );
    }
    Ok(())
}
