//! Any NATS client can drive Flotilla: this test uses plain async-nats and JSON values only,
//! following docs/protocol.md — no Flotilla client code. (The services it talks to run
//! in-process with the deterministic `scripted` agent.)

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::consumer::{DeliverPolicy, pull};
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

async fn wait_for_end(js: &async_nats::jetstream::Context, run: &str) -> anyhow::Result<Value> {
    let consumer = js
        .get_stream("FLOTILLA_EVENTS")
        .await?
        .create_consumer(pull::OrderedConfig {
            filter_subject: format!("flotilla.event.{run}"),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let end = tokio::time::timeout(WAIT, async {
        while let Some(m) = messages.next().await {
            // Each message holds the events of one step (`protocol: 2`, `events: [...]`).
            let batch: Value = serde_json::from_slice(&m?.payload)?;
            assert_eq!(batch["protocol"], 2, "{batch}");
            for event in batch["events"].as_array().cloned().unwrap_or_default() {
                let phase = event["event"]["phase"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                if ["run_succeeded", "run_failed", "run_rejected"].contains(&phase.as_str()) {
                    return Ok::<_, anyhow::Error>(event);
                }
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    Ok(end)
}

#[tokio::test]
async fn a_plain_nats_client_submits_follows_and_reads_a_run() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert(
        "echo".to_string(),
        scripted("{task_id} <- [{dependencies}] 12.5%"),
    );
    let f = InProcess::start(1, agents).await?;

    let nc = async_nats::connect(f.server.url()).await?;
    let js = async_nats::jetstream::new(nc.clone());

    // 1. Submit through the durable intake subject, choosing the run id. (The run's own
    //    subject, `flotilla.submit.<run>`, is the other durable way: see step 7.)
    let run = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e11";
    let submission = json!({
        "protocol": 1,
        "run_id": run,
        "labels": {"team": "finance"},
        "plan": {
            "name": "from-another-language",
            "subtasks": [
                {"id": "fetch", "description": "get figures", "produces": ["Figures"]},
                {"id": "analyse", "dependencies": ["fetch"], "consumes": ["figures"]}
            ],
            "config": {"max_retries": 1, "dependency_timeout": "2m"}
        }
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", run);
    headers.insert("Content-Type", "application/json");
    let ack = js
        .publish_with_headers(
            "flotilla.submit",
            headers,
            serde_json::to_vec(&submission)?.into(),
        )
        .await?
        .await?;
    assert_eq!(ack.stream, "FLOTILLA_INTAKE");

    // 2. Follow the run's events to its end.
    let end = wait_for_end(&js, run).await?;
    assert_eq!(end["event"]["phase"], "run_succeeded");
    assert_eq!(
        end["event"]["outcome"]["final_result"]["response"],
        "analyse <- [fetch] 12.5%"
    );
    assert_eq!(
        end["event"]["outcome"]["final_result"]["numeric_value"],
        12.5
    );

    // 3. Read the run through the request/reply API.
    let reply = nc
        .request(
            "flotilla.api.run.get",
            serde_json::to_vec(&json!({"run_id": run}))?.into(),
        )
        .await?;
    let view: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(view["record"]["status"], "succeeded");
    assert_eq!(view["record"]["labels"]["team"], "finance");
    assert_eq!(view["tasks"][1]["task_id"], "analyse");
    assert_eq!(view["tasks"][1]["status"], "succeeded");

    // 4. The same through the submit endpoint, synchronously, in MessagePack.
    let request = json!({"plan": {"subtasks": [{"id": "solo"}]}, "wait": true});
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/msgpack");
    let reply = tokio::time::timeout(
        Duration::from_secs(30),
        nc.request_with_headers(
            "flotilla.api.submit",
            headers,
            rmp_serde::to_vec_named(&request)?.into(),
        ),
    )
    .await??;
    let answer: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(answer["status"], "finished", "{answer}");
    assert_eq!(answer["outcome"]["status"], "succeeded");

    // 5. A rejection, synchronously: every problem, with codes and paths.
    let bad = json!({"plan": {"subtasks": [{"id": "a", "dependencies": ["a"]}, {"id": "b", "consumes": ["nothing"]}]}});
    let reply = nc
        .request("flotilla.api.submit", serde_json::to_vec(&bad)?.into())
        .await?;
    let answer: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(answer["status"], "rejected");
    let codes: Vec<&str> = answer["errors"]
        .as_array()
        .expect("errors")
        .iter()
        .filter_map(|e| e["code"].as_str())
        .collect();
    assert_eq!(codes, vec!["self_dependency", "missing_producer"]);
    assert_eq!(answer["errors"][0]["path"], "subtasks[0].dependencies[0]");

    // 7. Durably on the run's own subject: the submission is the run's first message, and
    //    JetStream refuses a second first message for the same run.
    let run2 = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e12";
    let submission = json!({"run_id": run2, "plan": {"subtasks": [{"id": "solo"}]}});
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Expected-Last-Subject-Sequence", "0");
    headers.insert("Nats-Msg-Id", format!("submit.{run2}").as_str());
    let ack = js
        .publish_with_headers(
            format!("flotilla.submit.{run2}"),
            headers.clone(),
            serde_json::to_vec(&submission)?.into(),
        )
        .await?
        .await?;
    assert_eq!(ack.stream, "FLOTILLA_RUNLOG");
    let again = js
        .publish_with_headers(
            format!("flotilla.submit.{run2}"),
            headers,
            serde_json::to_vec(&submission)?.into(),
        )
        .await?
        .await;
    assert!(again.is_err(), "a second first message is refused");
    let end = wait_for_end(&js, run2).await?;
    assert_eq!(end["event"]["phase"], "run_succeeded");

    // 8. On the run's own subject the run id is the identity: a body naming another run, or
    //    carrying an idempotency key (those belong on the intake subject), is rejected with
    //    the problems on the run record.
    let run3 = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e13";
    let confused = json!({
        "run_id": run2,
        "idempotency_key": "order-7",
        "plan": {"subtasks": [{"id": "solo"}]}
    });
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Expected-Last-Subject-Sequence", "0");
    js.publish_with_headers(
        format!("flotilla.submit.{run3}"),
        headers,
        serde_json::to_vec(&confused)?.into(),
    )
    .await?
    .await?;
    let end = wait_for_end(&js, run3).await?;
    assert_eq!(end["event"]["phase"], "run_rejected", "{end}");
    let reply = nc
        .request(
            "flotilla.api.run.get",
            serde_json::to_vec(&json!({"run_id": run3}))?.into(),
        )
        .await?;
    let view: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(view["record"]["status"], "rejected");
    let codes: Vec<&str> = view["record"]["errors"]
        .as_array()
        .expect("errors")
        .iter()
        .filter_map(|e| e["code"].as_str())
        .collect();
    assert_eq!(
        codes,
        vec!["run_id_mismatch", "misplaced_idempotency_key"],
        "{view}"
    );
    // The run it named is untouched.
    let reply = nc
        .request(
            "flotilla.api.run.get",
            serde_json::to_vec(&json!({"run_id": run2}))?.into(),
        )
        .await?;
    let view: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(view["record"]["status"], "succeeded");

    // 6. The micro service is discoverable with standard tooling.
    let info = nc.request("$SRV.INFO.flotilla", "".into()).await?;
    let info: Value = serde_json::from_slice(&info.payload)?;
    let subjects: Vec<&str> = info["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(|e| e["subject"].as_str())
        .collect();
    assert!(
        subjects.contains(&"flotilla.api.submit") && subjects.contains(&"flotilla.api.run.get"),
        "{subjects:?}"
    );
    f.stop().await;
    Ok(())
}

/// Sends `body` to `flotilla.api.<endpoint>`; returns the error status header (if any) and
/// the JSON answer.
async fn call(
    nc: &async_nats::Client,
    endpoint: &str,
    body: Vec<u8>,
) -> anyhow::Result<(Option<u16>, Value)> {
    let reply = nc
        .request(format!("flotilla.api.{endpoint}"), body.into())
        .await?;
    let status = reply
        .headers
        .as_ref()
        .and_then(|h| h.get("Nats-Service-Error-Code"))
        .map(|v| v.as_str().parse::<u16>())
        .transpose()?;
    Ok((status, serde_json::from_slice(&reply.payload)?))
}

/// A successful answer of `endpoint` to the JSON `body`.
async fn ok(nc: &async_nats::Client, endpoint: &str, body: Value) -> anyhow::Result<Value> {
    let (status, answer) = call(nc, endpoint, serde_json::to_vec(&body)?).await?;
    anyhow::ensure!(status.is_none(), "{endpoint} {body}: {answer}");
    Ok(answer)
}

/// Submits `plan` through the API and waits for the run's end; returns the run id.
async fn run_to_end(nc: &async_nats::Client, submission: Value) -> anyhow::Result<String> {
    let reply = tokio::time::timeout(
        WAIT,
        nc.request(
            "flotilla.api.submit",
            serde_json::to_vec(&submission)?.into(),
        ),
    )
    .await??;
    let answer: Value = serde_json::from_slice(&reply.payload)?;
    assert_eq!(answer["status"], "finished", "{answer}");
    assert_eq!(answer["outcome"]["status"], "succeeded", "{answer}");
    Ok(answer["run_id"]
        .as_str()
        .expect("the answer names the run")
        .to_owned())
}

#[tokio::test]
async fn a_plain_nats_client_shares_workspace_mailboxes_and_state() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} done"));
    let f = InProcess::start(1, agents).await?;
    let nc = async_nats::connect(f.server.url()).await?;

    let session = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e99";
    let run = run_to_end(
        &nc,
        json!({
            "session_id": session,
            "wait": true,
            "plan": {"subtasks": [
                {"id": "draft", "produces": ["figures"], "output_key": "summary"},
                {"id": "review", "dependencies": ["draft"], "consumes": ["figures"]}
            ]}
        }),
    )
    .await?;

    // Workspace: appends (the topic is normalised), read back in pages by since_seq.
    let mut seqs = Vec::new();
    for i in 0..5 {
        let mut request = json!({"run_id": run, "topic": "Quarterly Figures", "entry": {"i": i}});
        if i == 4 {
            request["by"] = json!("billing");
        }
        let reply = ok(&nc, "ws.append", request).await?;
        assert_eq!(reply["topic"], "quarterly_figures");
        assert_eq!(reply["duplicate"], false);
        seqs.push(reply["seq"].as_u64().expect("seq"));
    }
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let (mut since, mut read, mut pages) = (0, Vec::new(), Vec::new());
    loop {
        let page = ok(
            &nc,
            "ws.read",
            json!({"run_id": run, "topic": "quarterly_figures", "since_seq": since, "limit": 2}),
        )
        .await?;
        let entries = page["entries"].as_array().cloned().unwrap_or_default();
        pages.push(entries.len());
        read.extend(entries);
        since = page["next_since_seq"].as_u64().expect("next_since_seq");
        if page["more"] == false {
            break;
        }
    }
    assert_eq!(pages, vec![2, 2, 1]);
    let values: Vec<&Value> = read.iter().map(|e| &e["entry"]["i"]).collect();
    assert_eq!(
        values,
        vec![&json!(0), &json!(1), &json!(2), &json!(3), &json!(4)]
    );
    assert_eq!(read[0]["writer"]["by"], "operator");
    assert_eq!(read[0]["writer"]["run_id"], run.as_str());
    assert_eq!(read[4]["writer"]["by"], "billing");
    assert_eq!(read[4]["seq"].as_u64(), seqs.last().copied());
    assert_eq!(since, seqs[4]);

    // A task writes as itself, to a topic it declares.
    let reply = ok(
        &nc,
        "ws.append",
        json!({"run_id": run, "topic": "figures", "entry": {"revenue": 1250}, "task_id": "draft", "attempt": 1}),
    )
    .await?;
    let page = ok(&nc, "ws.read", json!({"run_id": run, "topic": "figures"})).await?;
    let entries = page["entries"].as_array().expect("entries");
    // The coordinator's automatic produce first, then the task's own entry.
    assert_eq!(entries.len(), 2, "{page}");
    assert_eq!(entries[0]["writer"]["by"], "coordinator");
    assert_eq!(entries[1]["seq"], reply["seq"]);
    assert_eq!(entries[1]["writer"]["task_id"], "draft");
    assert_eq!(entries[1]["writer"]["attempt"], 1);
    assert!(entries[1]["writer"].get("by").is_none(), "{page}");

    // Every topic of the tree at once, and idempotency keys.
    let all = ok(&nc, "ws.read", json!({"run_id": run})).await?;
    assert_eq!(all["entries"].as_array().map(Vec::len), Some(7), "{all}");
    let once =
        json!({"run_id": run, "topic": "dedup", "entry": {"x": 1}, "idempotency_key": "order-7"});
    let first = ok(&nc, "ws.append", once.clone()).await?;
    let again = ok(&nc, "ws.append", once).await?;
    assert_eq!(
        (again["duplicate"].clone(), &again["seq"]),
        (json!(true), &first["seq"])
    );

    // A page is cut to fit one NATS message (1 MiB here): three entries of 400 kB come in
    // two pages, none lost.
    let large = "x".repeat(400 * 1024);
    for i in 0..3 {
        ok(
            &nc,
            "ws.append",
            json!({"run_id": run, "topic": "large", "entry": {"i": i, "data": large}}),
        )
        .await?;
    }
    let first = ok(&nc, "ws.read", json!({"run_id": run, "topic": "large"})).await?;
    let second = ok(
        &nc,
        "ws.read",
        json!({"run_id": run, "topic": "large", "since_seq": first["next_since_seq"]}),
    )
    .await?;
    let sizes = |p: &Value| p["entries"].as_array().map_or(0, Vec::len);
    assert_eq!((sizes(&first), &first["more"]), (2, &json!(true)));
    assert_eq!((sizes(&second), &second["more"]), (1, &json!(false)));
    assert_eq!(second["entries"][0]["entry"]["i"], 2);

    // Mailboxes: a task and a client outside the plan write to a task; pairs number their
    // posts.
    let send = |from: &str, to: &str, kind: &str, attempt: Option<u32>| {
        let mut m =
            json!({"run_id": run, "from": from, "to": to, "type": kind, "payload": {"from": from}});
        if let Some(a) = attempt {
            m["attempt"] = json!(a);
        }
        m
    };
    let a = ok(
        &nc,
        "mbox.send",
        send("review", "draft", "request", Some(1)),
    )
    .await?;
    let b = ok(&nc, "mbox.send", send("dashboard", "draft", "info", None)).await?;
    let c = ok(&nc, "mbox.send", send("review", "draft", "info", None)).await?;
    let d = ok(&nc, "mbox.send", send("dashboard", "*", "info", None)).await?;
    assert_eq!(
        [&a["n"], &b["n"], &c["n"], &d["n"]],
        [&json!(1), &json!(1), &json!(2), &json!(1)]
    );
    let page = ok(
        &nc,
        "mbox.read",
        json!({"run_id": run, "reader": "draft", "since_seq": 0, "limit": 2}),
    )
    .await?;
    assert_eq!(page["more"], true, "{page}");
    let first_two = page["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(first_two.len(), 2);
    assert_eq!(first_two[0]["type"], "request");
    assert_eq!(first_two[0]["sender"]["task_id"], "review");
    assert_eq!(first_two[0]["sender"]["attempt"], 1);
    assert_eq!(first_two[1]["from"], "dashboard");
    assert_eq!(first_two[1]["sender"]["by"], "operator");
    let page = ok(
        &nc,
        "mbox.read",
        json!({"run_id": run, "reader": "draft", "since_seq": page["next_since_seq"]}),
    )
    .await?;
    let rest = page["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(page["more"], false, "{page}");
    assert_eq!(rest.len(), 2);
    assert_eq!((&rest[0]["n"], &rest[1]["to"]), (&json!(2), &json!("*")));

    // Reading from the committed cursor, committing: each message is returned once.
    let committed =
        |limit: u32| json!({"run_id": run, "reader": "draft", "limit": limit, "commit": true});
    let one = ok(&nc, "mbox.read", committed(3)).await?;
    let two = ok(&nc, "mbox.read", committed(3)).await?;
    let three = ok(&nc, "mbox.read", committed(3)).await?;
    let count = |p: &Value| p["messages"].as_array().map_or(0, Vec::len);
    assert_eq!((count(&one), count(&two), count(&three)), (3, 1, 0));
    assert_eq!(two["messages"][0]["seq"], d["seq"]);

    // A read that waits returns as soon as a message arrives. (The listener first takes
    // the broadcast it has.)
    let broadcast = ok(
        &nc,
        "mbox.read",
        json!({"run_id": run, "reader": "listener", "commit": true}),
    )
    .await?;
    assert_eq!(broadcast["messages"][0]["seq"], d["seq"], "{broadcast}");
    let reader = nc.clone();
    let waiting_run = run.clone();
    let started = std::time::Instant::now();
    let waiting = tokio::spawn(async move {
        ok(
            &reader,
            "mbox.read",
            json!({"run_id": waiting_run, "reader": "listener", "wait_ms": 5000}),
        )
        .await
    });
    ok(&nc, "mbox.send", send("review", "listener", "info", None)).await?;
    let woken = waiting.await??;
    assert_eq!(count(&woken), 1, "{woken}");
    assert_eq!(woken["messages"][0]["to"], "listener", "{woken}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let empty = ok(
        &nc,
        "mbox.read",
        json!({"run_id": run, "reader": "listener", "wait_ms": 100}),
    )
    .await?;
    // Not committed: the woken read's message again, then nothing after it.
    assert_eq!(empty["messages"][0]["seq"], woken["messages"][0]["seq"]);
    let empty = ok(
        &nc,
        "mbox.read",
        json!({"run_id": run, "reader": "listener", "since_seq": woken["next_since_seq"], "wait_ms": 100}),
    )
    .await?;
    assert_eq!((count(&empty), &empty["more"]), (0, &json!(false)));

    // Mailbox pages are cut the same way, and a committing read commits only what it
    // returned.
    for i in 0..3 {
        ok(
            &nc,
            "mbox.send",
            json!({"run_id": run, "from": "review", "to": "bulk", "type": "info", "payload": {"i": i, "data": large}}),
        )
        .await?;
    }
    let bulk = json!({"run_id": run, "reader": "bulk", "commit": true});
    let first = ok(&nc, "mbox.read", bulk.clone()).await?;
    let second = ok(&nc, "mbox.read", bulk).await?;
    // The dashboard's broadcast and two large posts, then the third.
    assert_eq!((count(&first), &first["more"]), (3, &json!(true)));
    assert_eq!(first["messages"][0]["seq"], d["seq"]);
    assert_eq!((count(&second), &second["more"]), (1, &json!(false)));
    assert_eq!(second["messages"][0]["payload"]["i"], 2);

    // Session state: set, get (by run or by session), compare-and-set.
    let set = ok(
        &nc,
        "state.set",
        json!({"run_id": run, "key": "notes", "value": {"ok": true}}),
    )
    .await?;
    let r1 = set["revision"].as_u64().expect("revision");
    let got = ok(&nc, "state.get", json!({"run_id": run, "key": "notes"})).await?;
    assert_eq!(
        (&got["value"], got["revision"].as_u64()),
        (&json!({"ok": true}), Some(r1))
    );
    let set = ok(
        &nc,
        "state.set",
        json!({"session_id": session, "key": "notes", "value": 2, "expected_revision": r1}),
    )
    .await?;
    let r2 = set["revision"].as_u64().expect("revision");
    assert!(r2 > r1);
    let got = ok(
        &nc,
        "state.get",
        json!({"session_id": session, "key": "notes"}),
    )
    .await?;
    assert_eq!(
        (&got["value"], got["revision"].as_u64()),
        (&json!(2), Some(r2))
    );
    ok(
        &nc,
        "state.set",
        json!({"run_id": run, "key": "fresh", "value": "new", "expected_revision": 0}),
    )
    .await?;

    // A task's output_key is session state, readable by the run.
    let summary = ok(&nc, "state.get", json!({"run_id": run, "key": "summary"})).await?;
    assert_eq!(summary["value"], "draft done");

    // The endpoints are part of the discoverable service.
    let info = nc.request("$SRV.INFO.flotilla", "".into()).await?;
    let info: Value = serde_json::from_slice(&info.payload)?;
    let subjects: Vec<&str> = info["endpoints"]
        .as_array()
        .expect("endpoints")
        .iter()
        .filter_map(|e| e["subject"].as_str())
        .collect();
    for endpoint in [
        "ws.append",
        "ws.read",
        "mbox.send",
        "mbox.read",
        "state.get",
        "state.set",
    ] {
        assert!(
            subjects.contains(&format!("flotilla.api.{endpoint}").as_str()),
            "{subjects:?}"
        );
    }
    f.stop().await;
    Ok(())
}

/// The last sequence of the workspace and mailbox streams and of the state and cursors
/// buckets: any write moves one of them.
async fn stored(js: &async_nats::jetstream::Context) -> anyhow::Result<[u64; 4]> {
    let mut out = [0; 4];
    for (i, stream) in [
        "FLOTILLA_WORKSPACE",
        "FLOTILLA_MAILBOX",
        "KV_flotilla-state",
        "KV_flotilla-cursors",
    ]
    .into_iter()
    .enumerate()
    {
        out[i] = js
            .get_stream(stream)
            .await?
            .get_info()
            .await?
            .state
            .last_sequence;
    }
    Ok(out)
}

#[tokio::test]
async fn collaboration_endpoints_refuse_bad_input_and_store_nothing() -> anyhow::Result<()> {
    let mut agents = BTreeMap::new();
    agents.insert("echo".to_string(), scripted("{task_id} done"));
    let f = InProcess::start(1, agents).await?;
    let nc = async_nats::connect(f.server.url()).await?;
    let js = async_nats::jetstream::new(nc.clone());
    let run = run_to_end(
        &nc,
        json!({"wait": true, "plan": {"subtasks": [{"id": "draft", "produces": ["figures"]}]}}),
    )
    .await?;
    // The run's own write (automatic produce) is in: nothing else writes from here on.
    let page = ok(&nc, "ws.read", json!({"run_id": run, "topic": "figures"})).await?;
    assert_eq!(page["entries"].as_array().map(Vec::len), Some(1), "{page}");
    let state = ok(
        &nc,
        "state.set",
        json!({"run_id": run, "key": "k", "value": 1}),
    )
    .await?;
    let revision = state["revision"].as_u64().expect("revision");
    let before = stored(&js).await?;

    let unknown = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e00";
    let big = "x".repeat(1024 * 1024 - 3000);
    let j = |v: Value| v.to_string().into_bytes();
    // Endpoint, body, status, code.
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        // ws.append
        ("ws.append", b"{not json".to_vec(), 400, "malformed"),
        ("ws.append", j(json!({"run_id": run, "topic": "t", "entry": [1]})), 400, "malformed"),
        ("ws.append", j(json!({"run_id": run, "topic": "t", "entry": {}, "extra": 1})), 400, "malformed"),
        ("ws.append", j(json!({"run_id": "not-a-uuid", "topic": "t", "entry": {}})), 400, "malformed"),
        ("ws.append", j(json!({"protocol": 2, "run_id": run, "topic": "t", "entry": {}})), 400, "unsupported_protocol"),
        ("ws.append", j(json!({"protocol": 0, "run_id": run, "topic": "t", "entry": {}})), 400, "unsupported_protocol"),
        ("ws.append", j(json!({"run_id": unknown, "topic": "t", "entry": {}})), 404, "unknown_run"),
        ("ws.append", j(json!({"run_id": run, "topic": "a.b", "entry": {}})), 400, "invalid_topic"),
        ("ws.append", j(json!({"run_id": run, "topic": "x*", "entry": {}})), 400, "invalid_topic"),
        ("ws.append", j(json!({"run_id": run, "topic": "  ", "entry": {}})), 400, "invalid_topic"),
        ("ws.append", j(json!({"run_id": run, "topic": "t", "entry": {"blob": big}})), 413, "entry_too_large"),
        ("ws.append", j(json!({"run_id": run, "topic": "other", "entry": {}, "task_id": "draft"})), 400, "undeclared_topic"),
        ("ws.append", j(json!({"run_id": run, "topic": "figures", "entry": {}, "task_id": "ghost"})), 400, "unknown_task"),
        ("ws.append", j(json!({"run_id": run, "topic": "figures", "entry": {}, "task_id": "draft", "by": "me"})), 400, "invalid_writer"),
        ("ws.append", j(json!({"run_id": run, "topic": "figures", "entry": {}, "task_id": "draft", "attempt": 0})), 400, "invalid_writer"),
        ("ws.append", j(json!({"run_id": run, "topic": "t", "entry": {}, "attempt": 1})), 400, "invalid_writer"),
        ("ws.append", j(json!({"run_id": run, "topic": "t", "entry": {}, "by": "coordinator"})), 400, "invalid_writer"),
        ("ws.append", j(json!({"run_id": run, "topic": "t", "entry": {}, "by": "two words"})), 400, "invalid_writer"),
        // ws.read
        ("ws.read", b"[]".to_vec(), 400, "malformed"),
        ("ws.read", j(json!({"protocol": 9, "run_id": run})), 400, "unsupported_protocol"),
        ("ws.read", j(json!({"run_id": unknown})), 404, "unknown_run"),
        ("ws.read", j(json!({"run_id": run, "topic": "a>b"})), 400, "invalid_topic"),
        ("ws.read", j(json!({"run_id": run, "limit": 0})), 400, "invalid_limit"),
        ("ws.read", j(json!({"run_id": run, "limit": 1001})), 400, "invalid_limit"),
        ("ws.read", j(json!({"run_id": run, "since_seq": -1})), 400, "malformed"),
        // mbox.send
        ("mbox.send", b"{\"run_id\":".to_vec(), 400, "malformed"),
        ("mbox.send", j(json!({"run_id": run, "from": "a", "to": "draft", "type": "gossip"})), 400, "malformed"),
        ("mbox.send", j(json!({"protocol": 2, "run_id": run, "from": "a", "to": "draft", "type": "info"})), 400, "unsupported_protocol"),
        ("mbox.send", j(json!({"run_id": unknown, "from": "a", "to": "draft", "type": "info"})), 404, "unknown_run"),
        ("mbox.send", j(json!({"run_id": run, "from": "a", "to": "dr.aft", "type": "info"})), 400, "invalid_address"),
        ("mbox.send", j(json!({"run_id": run, "from": "a", "to": "_all", "type": "info"})), 400, "invalid_address"),
        ("mbox.send", j(json!({"run_id": run, "from": "_x", "to": "draft", "type": "info"})), 400, "invalid_address"),
        ("mbox.send", j(json!({"run_id": run, "from": "a b", "to": "draft", "type": "info"})), 400, "invalid_address"),
        ("mbox.send", j(json!({"run_id": run, "from": "outsider", "to": "draft", "type": "info", "attempt": 1})), 400, "invalid_writer"),
        ("mbox.send", j(json!({"run_id": run, "from": "a", "to": "draft", "type": "info", "payload": big})), 413, "payload_too_large"),
        // mbox.read
        ("mbox.read", b"".to_vec(), 400, "malformed"),
        ("mbox.read", j(json!({"protocol": 2, "run_id": run, "reader": "draft"})), 400, "unsupported_protocol"),
        ("mbox.read", j(json!({"run_id": unknown, "reader": "draft"})), 404, "unknown_run"),
        ("mbox.read", j(json!({"run_id": run, "reader": "*"})), 400, "invalid_address"),
        ("mbox.read", j(json!({"run_id": run, "reader": "draft", "limit": 0})), 400, "invalid_limit"),
        ("mbox.read", j(json!({"run_id": run, "reader": "draft", "limit": 5000, "commit": true})), 400, "invalid_limit"),
        ("mbox.read", j(json!({"run_id": run, "reader": "draft", "wait_ms": 60000})), 400, "invalid_limit"),
        // state.set
        ("state.set", b"{\"key\": 1}".to_vec(), 400, "malformed"),
        ("state.set", j(json!({"protocol": 2, "run_id": run, "key": "k", "value": 2})), 400, "unsupported_protocol"),
        ("state.set", j(json!({"run_id": unknown, "key": "k", "value": 2})), 404, "unknown_run"),
        ("state.set", j(json!({"key": "k", "value": 2})), 400, "invalid_scope"),
        ("state.set", j(json!({"run_id": run, "session_id": unknown, "key": "k", "value": 2})), 400, "invalid_scope"),
        ("state.set", j(json!({"run_id": run, "key": "a.b", "value": 2})), 400, "invalid_key"),
        ("state.set", j(json!({"run_id": run, "key": "", "value": 2})), 400, "invalid_key"),
        ("state.set", j(json!({"run_id": run, "key": "k".repeat(129), "value": 2})), 400, "invalid_key"),
        ("state.set", j(json!({"run_id": run, "key": "k", "value": "x".repeat(300 * 1024)})), 413, "value_too_large"),
        ("state.set", j(json!({"run_id": run, "key": "k", "value": 2, "expected_revision": revision + 5})), 409, "conflict"),
        ("state.set", j(json!({"run_id": run, "key": "k", "value": 2, "expected_revision": 0})), 409, "conflict"),
        // state.get
        ("state.get", b"nope".to_vec(), 400, "malformed"),
        ("state.get", j(json!({"protocol": 2, "run_id": run, "key": "k"})), 400, "unsupported_protocol"),
        ("state.get", j(json!({"run_id": unknown, "key": "k"})), 404, "unknown_run"),
        ("state.get", j(json!({"run_id": run, "key": "no/such"})), 400, "invalid_key"),
        ("state.get", j(json!({"run_id": run, "key": "missing"})), 404, "not_found"),
    ];
    for (endpoint, body, status, code) in cases {
        let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        let (header, err) = call(&nc, endpoint, body).await?;
        assert_eq!(header, Some(status), "{endpoint} {shown}: {err}");
        assert_eq!(err["status"], status, "{endpoint} {shown}: {err}");
        assert_eq!(err["code"], code, "{endpoint} {shown}: {err}");
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{endpoint} {shown}: {err}"
        );
        if code == "conflict" {
            // The answer says where the key is now.
            assert_eq!(err["current_revision"].as_u64(), Some(revision), "{err}");
        }
        assert_eq!(
            stored(&js).await?,
            before,
            "{endpoint} {shown} stored something"
        );
    }
    // The state is untouched, and the service still answers.
    let got = ok(&nc, "state.get", json!({"run_id": run, "key": "k"})).await?;
    assert_eq!(
        (&got["value"], got["revision"].as_u64()),
        (&json!(1), Some(revision))
    );
    f.stop().await;
    Ok(())
}

/// `protocol` is optional on every request, as the conventions of docs/protocol.md say: each
/// request kind of the coordinators' and the supervisors' APIs, sent without it, is read
/// (whatever the answer, never `400 malformed`); the same body with `"protocol": 1` shows the
/// rest of the body is a well-formed request of its kind.
#[tokio::test]
async fn every_request_kind_is_read_without_protocol() -> anyhow::Result<()> {
    let mut p = Processes::start(
        "[agents.echo]\nkind = \"scripted\"\nreply = \"done\"\nroles = [\"writer\"]\n",
    )
    .await?;
    p.coordinator().await?;
    p.supervisor().await?;
    let nc = p.bus.client().clone();
    // A run that exists (no worker: it waits), and one that does not.
    let run = p
        .client
        .submit(flotilla_model::submit::SubmitRequest::new(plan(vec![
            flotilla_model::plan::Subtask::new("a", "x"),
        ])))
        .await?
        .to_string();
    let ghost = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e00";
    let session = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e01";
    let attempt = "0190f0c4-8a3e-7cc1-9a39-6f1c1b7d2e02";
    let subtasks = json!({"subtasks": [{"id": "a"}]});
    #[rustfmt::skip]
    let requests: Vec<(&str, Value)> = vec![
        ("submit", json!({"plan": subtasks})),
        ("run.get", json!({"run_id": run})),
        ("run.cancel", json!({"run_id": ghost})),
        ("run.pause", json!({"run_id": ghost})),
        ("run.resume", json!({"run_id": ghost})),
        ("run.takeover", json!({"run_id": ghost})),
        ("run.complete", json!({"run_id": ghost, "task_id": "a", "result": "r", "by": "me"})),
        ("run.edit", json!({"run_id": ghost, "plan": subtasks, "by": "me"})),
        ("run.tree", json!({"run_id": run})),
        ("run.diff", json!({"a": run, "b": run})),
        ("run.fork", json!({"run_id": ghost, "at": "a"})),
        ("session.get", json!({"session_id": session})),
        ("plan.validate", json!({"plan": subtasks})),
        ("watch", json!({"run_id": ghost, "deliver_subject": "_INBOX.nobody"})),
        ("child.start", json!({"submission": {"plan": subtasks}})),
        ("ws.append", json!({"run_id": run, "topic": "t", "entry": {}})),
        ("ws.read", json!({"run_id": run})),
        ("mbox.send", json!({"run_id": run, "from": "me", "to": "a", "type": "info"})),
        ("mbox.read", json!({"run_id": run, "reader": "a"})),
        ("mbox.role", json!({"run_id": run, "role": "writer"})),
        ("mbox.negotiate", json!({"run_id": ghost, "from": "me", "candidates": ["a"], "deadline_ms": 1000})),
        ("state.get", json!({"run_id": run, "key": "k"})),
        ("state.list", json!({"run_id": run})),
        ("state.set", json!({"run_id": run, "key": "k", "value": 1})),
        ("approval.ask", json!({"run_id": ghost, "task_id": "a", "attempt": 1, "attempt_id": attempt,
            "agent": "ext", "query_id": "q1", "question": "may I?"})),
        ("approval.list", json!({})),
        ("approval.get", json!({"run_id": run, "approval_id": "a.1"})),
        ("approval.answer", json!({"run_id": run, "approval_id": "a.1", "decision": "approve", "by": "me"})),
        ("approval.grants", json!({"run_id": run})),
        ("approval.revoke", json!({"run_id": run, "tool": "shell", "by": "me"})),
        ("team.list", json!({})),
        ("team.get", json!({"name": "echo"})),
        ("team.find", json!({"role": "writer"})),
        ("team.stats", json!({})),
        ("team.recruit", json!({"run_id": ghost, "recruit_id": "r1", "role": "writer",
            "description": "d", "reason": "why"})),
        ("team.recruit_status", json!({"run_id": ghost, "recruit_id": "r1"})),
        ("team.retire", json!({"run_id": ghost, "member": "echo", "reason": "why"})),
        ("team.assign", json!({"run_id": ghost, "task_id": "a"})),
        ("team.finish", json!({"run_id": ghost, "result": "r"})),
        ("team.spawn", json!({"name": "mate", "role": "writer", "instructions": "help", "agent": "ghost-agent"})),
        ("team.send", json!({"to": "nobody", "text": "hi"})),
        ("team.broadcast", json!({"text": "hi", "team": "nobody"})),
        ("team.shutdown", json!({"name": "nobody"})),
        ("team.mates", json!({})),
        ("memory.list", json!({})),
        ("memory.get", json!({"run_id": ghost})),
        ("memory.forget", json!({"run_id": ghost})),
        ("trust.list", json!({})),
        ("trust.get", json!({"name": "echo"})),
        ("trust.set", json!({"name": "echo", "level": "novice", "reason": "test", "by": "me"})),
        ("trust.incident", json!({"name": "echo", "reason": "test", "by": "me"})),
    ];
    // Every request kind is in the table.
    let kinds: std::collections::BTreeSet<&str> = requests.iter().map(|(k, _)| *k).collect();
    let schemas: Vec<String> = flotilla_model::schema::public_schemas()
        .into_iter()
        .map(|(name, _)| name.to_owned())
        .filter(|n| n.ends_with("-request.json"))
        .collect();
    assert_eq!(kinds.len(), requests.len(), "each kind once");
    assert_eq!(
        kinds.len(),
        schemas.len(),
        "one row per request kind: {kinds:?} vs {schemas:?}"
    );
    for (endpoint, body) in requests {
        assert!(body.get("protocol").is_none());
        let mut versioned = body.clone();
        versioned["protocol"] = json!(1);
        for sent in [versioned, body] {
            let reply = tokio::time::timeout(
                Duration::from_secs(30),
                call(&nc, endpoint, serde_json::to_vec(&sent)?),
            )
            .await
            .map_err(|_| anyhow::anyhow!("{endpoint} {sent}: no answer"))??;
            assert_ne!(
                (reply.0, reply.1["code"].as_str()),
                (Some(400), Some("malformed")),
                "{endpoint} {sent}: {}",
                reply.1
            );
        }
    }
    Ok(())
}
