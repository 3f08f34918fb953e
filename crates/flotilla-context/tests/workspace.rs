//! Workspace topics against a real nats-server: lossless paging, live watching, idempotent
//! appends, data-flow rules, limits and malformed raw messages.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use bytes::Bytes;
use common::{obj, server, task, task_scope};
use flotilla_context::Clients;
use flotilla_model::ids::{AttemptId, RunId};
use flotilla_model::plan::DataflowValidation;
use flotilla_model::workspace::WorkspacePage;
use futures::StreamExt;
use serde_json::json;

/// Reads a topic (or every topic) to the end with `limit`, checking the page invariants.
async fn read_to_end(
    c: &Clients,
    topic: Option<&str>,
    limit: usize,
) -> anyhow::Result<(Vec<u64>, Vec<i64>, usize)> {
    let ws = c.workspace();
    let (mut since, mut seqs, mut values, mut pages) = (0, Vec::new(), Vec::new(), 0);
    loop {
        let page: WorkspacePage = match topic {
            Some(t) => ws.read(t, since, Some(limit)).await?,
            None => ws.read_all(since, Some(limit)).await?,
        };
        pages += 1;
        assert!(page.entries.len() <= limit.min(1000));
        for e in &page.entries {
            assert!(e.seq > since, "entries come after since_seq");
            seqs.push(e.seq);
            values.push(e.entry["i"].as_i64().unwrap_or(-1));
        }
        assert!(page.next_since_seq >= since);
        since = page.next_since_seq;
        if !page.more {
            break;
        }
    }
    Ok((seqs, values, pages))
}

#[tokio::test]
async fn paging_reaches_every_one_of_5000_entries_once_in_order() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "fetch_data")?;
    let ws = c.workspace();
    // 5,000 entries on `data` and 500 on `noise`, appended concurrently so sequences of the
    // two topics interleave.
    let appends = (0..5500i64).map(|i| {
        let ws = ws.clone();
        async move {
            let topic = if i < 5000 { "data" } else { "noise" };
            let n = if i < 5000 { i } else { i - 5000 };
            ws.append(topic, obj(json!({"i": n}))).await
        }
    });
    let results: Vec<_> = futures::stream::iter(appends)
        .buffer_unordered(64)
        .collect()
        .await;
    for r in results {
        assert!(!r?.duplicate);
    }
    for (limit, pages) in [(200, 25), (1000, 5)] {
        let (seqs, values, n_pages) = read_to_end(&c, Some("data"), limit).await?;
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "in sequence order");
        assert_eq!(values.len(), 5000, "limit {limit}");
        let distinct: BTreeSet<i64> = values.iter().copied().collect();
        assert_eq!(distinct, (0..5000).collect(), "each entry exactly once");
        assert_eq!(n_pages, pages, "limit {limit}");
    }
    // A limit above the maximum is lowered to 1,000, not refused.
    let (_, values, n_pages) = read_to_end(&c, Some("data"), 50_000).await?;
    assert_eq!((values.len(), n_pages), (5000, 5));
    // Every topic of the tree: 5,500 entries, each once, in order.
    let (seqs, values, _) = read_to_end(&c, None, 1000).await?;
    assert_eq!(values.len(), 5500);
    assert!(seqs.windows(2).all(|w| w[0] < w[1]));
    // Another run tree's workspace is separate.
    let other = task(&bus, RunId::new(), "x")?;
    assert!(
        other
            .workspace()
            .read_all(0, None)
            .await?
            .entries
            .is_empty()
    );
    Ok(())
}

#[tokio::test]
async fn watch_streams_stored_then_live_entries() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "writer")?;
    let ws = c.workspace();
    let first = ws.append("q3", obj(json!({"i": 1}))).await?;
    ws.append("q3", obj(json!({"i": 2}))).await?;
    let watch = ws.watch(Some("Q3"), first.seq).await?;
    let all = ws.watch(None, 0).await?;
    futures::pin_mut!(watch);
    futures::pin_mut!(all);
    let t = Duration::from_secs(10);
    let e = tokio::time::timeout(t, watch.next())
        .await?
        .expect("stored entry")?;
    assert_eq!(e.entry["i"], 2, "entries after since_seq only");
    // Entries appended after the watch started arrive live, on either topic for `all`.
    ws.append("q3", obj(json!({"i": 3}))).await?;
    ws.append("other", obj(json!({"i": 4}))).await?;
    let e = tokio::time::timeout(t, watch.next())
        .await?
        .expect("live entry")?;
    assert_eq!((e.topic.as_str(), e.entry["i"].as_i64()), ("q3", Some(3)));
    let seen: Vec<i64> = tokio::time::timeout(
        t,
        all.take(4)
            .map(|e| e.map(|e| e.entry["i"].as_i64().unwrap_or(0)))
            .collect::<Vec<_>>(),
    )
    .await?
    .into_iter()
    .collect::<Result<_, _>>()?;
    assert_eq!(seen, vec![1, 2, 3, 4]);
    Ok(())
}

#[tokio::test]
async fn appends_are_idempotent_per_attempt() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let scope = task_scope(&bus, run, "fetch_data");
    let c = common::clients(&bus, scope.clone())?;
    let a = c
        .workspace()
        .append("data", obj(json!({"q": 3, "rev": [1, 2]})))
        .await?;
    assert!(!a.duplicate);
    // The same entry again, keys in another order: stored once.
    let again = c
        .workspace()
        .append("data", obj(json!({"rev": [1, 2], "q": 3})))
        .await?;
    assert!(again.duplicate);
    assert_eq!(again.seq, a.seq);
    // A redelivery of the same attempt (a new process, delivery 2): stored once.
    let redelivered = common::clients(
        &bus,
        flotilla_context::Scope {
            delivery: Some(2),
            ..scope.clone()
        },
    )?;
    let r = redelivered
        .workspace()
        .append("data", obj(json!({"q": 3, "rev": [1, 2]})))
        .await?;
    assert!(r.duplicate);
    assert_eq!(r.seq, a.seq);
    // A retry (another attempt) writes its own entry.
    let retry = common::clients(
        &bus,
        flotilla_context::Scope {
            attempt: Some(2),
            attempt_id: Some(AttemptId::new()),
            ..scope.clone()
        },
    )?;
    let b = retry
        .workspace()
        .append("data", obj(json!({"q": 3, "rev": [1, 2]})))
        .await?;
    assert!(!b.duplicate);
    // Operators: idempotent with a key, not without.
    let op = common::clients(
        &bus,
        flotilla_context::Scope::operator(bus.names().clone(), run, run, run.to_string()),
    )?;
    let k1 = op
        .workspace()
        .append_with_key("data", obj(json!({"x": 1})), Some("k"))
        .await?;
    let k2 = op
        .workspace()
        .append_with_key("data", obj(json!({"x": 2})), Some("k"))
        .await?;
    assert!(k2.duplicate && k2.seq == k1.seq);
    op.workspace().append("data", obj(json!({"x": 1}))).await?;
    op.workspace().append("data", obj(json!({"x": 1}))).await?;
    let page = c.workspace().read("data", 0, None).await?;
    assert_eq!(
        page.entries.len(),
        5,
        "attempt 1, attempt 2, keyed, two unkeyed"
    );
    let w = page.entries[0].writer.as_ref().expect("writer");
    assert_eq!(
        (w.task_id.as_ref().map(|t| t.as_str()), w.attempt),
        (Some("fetch_data"), Some(1))
    );
    assert_eq!(
        page.entries[2]
            .writer
            .as_ref()
            .and_then(|w| w.by.as_deref()),
        Some("operator")
    );
    Ok(())
}

#[tokio::test]
async fn strict_data_flow_refuses_undeclared_topics_and_lenient_allows_them() -> anyhow::Result<()>
{
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let strict = flotilla_context::Scope {
        produces: Some(vec!["growth_rate".into(), "notes".into()]),
        dataflow: DataflowValidation::Strict,
        ..task_scope(&bus, run, "calc_growth")
    };
    let c = common::clients(&bus, strict.clone())?;
    c.workspace()
        .append("Growth Rate", obj(json!({"v": 1})))
        .await?;
    let err = c
        .workspace()
        .append("margin", obj(json!({"v": 1})))
        .await
        .expect_err("undeclared");
    assert_eq!(err.code(), "undeclared_topic");
    let text = err.to_string();
    assert!(
        text.contains("\"margin\"") && text.contains("growth_rate, notes"),
        "{text}"
    );
    // Declaring nothing under strict: nothing may be written, and the error says so.
    let none = common::clients(
        &bus,
        flotilla_context::Scope {
            produces: Some(vec![]),
            ..strict.clone()
        },
    )?;
    let err = none
        .workspace()
        .append("growth_rate", obj(json!({})))
        .await
        .expect_err("declares nothing");
    assert!(err.to_string().contains("(none)"), "{err}");
    // Lenient: allowed.
    let lenient = common::clients(
        &bus,
        flotilla_context::Scope {
            dataflow: DataflowValidation::Lenient,
            ..strict
        },
    )?;
    lenient
        .workspace()
        .append("margin", obj(json!({"v": 2})))
        .await?;
    assert_eq!(
        c.workspace().read("margin", 0, None).await?.entries.len(),
        1
    );
    Ok(())
}

#[tokio::test]
async fn oversize_entries_and_bad_topics_are_refused_and_store_nothing() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "t")?;
    let ws = c.workspace();
    let big = "x".repeat(1024 * 1024 + 10);
    let err = ws
        .append("data", obj(json!({ "blob": big })))
        .await
        .expect_err("too large");
    assert_eq!(err.code(), "entry_too_large");
    let cap = (1024 * 1024usize).min(bus.max_payload() - 4096);
    let text = err.to_string();
    assert!(text.contains(&cap.to_string()), "names the cap: {text}");
    let size: usize = text
        .split("the entry is ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("names the size");
    assert!(
        size > 1024 * 1024 + 10 && size < 1024 * 1024 + 1024,
        "{text}"
    );
    for bad in ["a.b", "x*", ">", "", "  ", "tab\there"] {
        let err = ws.append(bad, obj(json!({}))).await.expect_err(bad);
        assert_eq!(err.code(), "invalid_topic", "{bad}");
        let err = ws.read(bad, 0, None).await.expect_err(bad);
        assert_eq!(err.code(), "invalid_topic", "{bad}");
        assert!(ws.watch(Some(bad), 0).await.is_err(), "{bad}");
    }
    assert!(ws.read_all(0, None).await?.entries.is_empty());
    Ok(())
}

#[tokio::test]
async fn malformed_raw_messages_are_skipped_and_readers_keep_going() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "t")?;
    let ws = c.workspace();
    let subject = bus.names().workspace(run, "data");
    let raw = |body: &'static str| {
        let js = bus.js().clone();
        let subject = subject.clone();
        async move { js.publish(subject, Bytes::from(body)).await?.await }
    };
    ws.append("data", obj(json!({"i": 0}))).await?;
    raw("not json").await?;
    raw(r#"{"entry": [1, 2]}"#).await?;
    raw(r#"{"entry": {"i": 1}}"#).await?; // a plain client's valid write: no writer
    raw("[]").await?;
    ws.append("data", obj(json!({"i": 2}))).await?;
    let page = ws.read("data", 0, None).await?;
    let values: Vec<i64> = page
        .entries
        .iter()
        .filter_map(|e| e.entry["i"].as_i64())
        .collect();
    assert_eq!(values, vec![0, 1, 2]);
    assert_eq!(page.skipped, 3);
    // Pages of one: the malformed ones are pages with no entry, and the cursor moves on.
    let (_, values, pages) = read_to_end(&c, Some("data"), 1).await?;
    assert_eq!(values, vec![0, 1, 2]);
    assert_eq!(pages, 6);
    // The watcher skips them too.
    let watch = ws.watch(Some("data"), 0).await?;
    let seen: Vec<i64> = tokio::time::timeout(
        Duration::from_secs(10),
        watch
            .take(3)
            .map(|e| e.map(|e| e.entry["i"].as_i64().unwrap_or(-1)))
            .collect::<Vec<_>>(),
    )
    .await?
    .into_iter()
    .collect::<Result<_, _>>()?;
    assert_eq!(seen, vec![0, 1, 2]);
    Ok(())
}

#[tokio::test]
async fn large_data_goes_to_an_artifact_with_a_reference_entry() -> anyhow::Result<()> {
    let (_server, bus) = server().await?;
    let run = RunId::new();
    let c = task(&bus, run, "t")?;
    let data = Bytes::from(vec![7u8; 3 * 1024 * 1024]);
    let (reference, appended) = c
        .workspace()
        .append_artifact("reports", "q3/full.bin", data.clone())
        .await?;
    let page = c.workspace().read("reports", 0, None).await?;
    assert_eq!(page.entries[0].seq, appended.seq);
    let stored: flotilla_model::artifact::ArtifactRef =
        serde_json::from_value(page.entries[0].entry["artifact"].clone())?;
    assert_eq!(stored, reference);
    assert_eq!(stored.size, data.len() as u64);
    assert_eq!(c.artifacts().get_ref(&stored).await?, data);
    // A bad topic stores nothing.
    let err = c
        .workspace()
        .append_artifact("a.b", "x", Bytes::from_static(b"x"))
        .await
        .expect_err("bad topic");
    assert_eq!(err.code(), "invalid_topic");
    assert_eq!(
        c.artifacts().get("x").await.expect_err("not stored").code(),
        "not_found"
    );
    Ok(())
}
