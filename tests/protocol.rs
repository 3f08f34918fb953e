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
