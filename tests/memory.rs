//! Supervisor memory across processes against a real nats-server: `flotilla coordinator`,
//! `flotilla worker` and `flotilla supervisor` processes; the planner is an LLM agent talking
//! to the test kit's scripted OpenAI-compatible server (a test double whose plans are scripted
//! here, not a model), and the planned tasks run a deterministic `scripted` agent, so every
//! request the double records is a planner call.
//!
//! A finished root run is remembered once (two supervisor replicas, and every event delivered
//! again to a fresh consumer); a child run is not; a similar bare query reuses the plan with
//! no planner call and the run says what it reused; a dissimilar one calls the planner (with
//! examples when some words match); at explore 100 % even an identical query is planned;
//! `forget` removes an entry; bad input is refused, structured, and changes nothing.

mod support;

use std::time::{Duration, Instant};

use flotilla_model::api::ApiError;
use flotilla_model::event::{Event, WorkflowPhase, decode_events};
use flotilla_model::ids::RunId;
use flotilla_model::memory::{
    MemoryDecision, MemoryEntry, MemoryForgetRequest, MemoryGetRequest, MemoryList,
    MemoryListRequest, MemoryReason, MemoryUse, QuerySource,
};
use flotilla_model::run::{RunHandle, RunStatus};
use flotilla_model::subjects::StreamKind;
use flotilla_model::submit::{SubmitRequest, SubmitStatus};
use flotilla_model::validate::ProblemCode;
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::json;
use support::*;

const ASK: Duration = Duration::from_secs(10);

fn config(base_url: &str, explore_percent: u8) -> String {
    format!(
        r#"default-agent = "echo"

[agents.planner]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = []

[agents.echo]
kind = "scripted"
reply = "{{task_id}}: done"

[agents.writer]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
tools = []

[coordinator.planner]
agent = "planner"

[coordinator.memory]
explore-percent = {explore_percent}
"#
    )
}

/// The planner's scripted answer: research, then a report.
fn plan_reply() -> Reply {
    Reply::text(
        json!({"name": "report", "subtasks": [
            {"id": "research", "description": "Find the quarter's figures.", "role": "researcher"},
            {"id": "report", "description": "Write the report.", "role": "synthesis",
             "dependencies": ["research"]}
        ]})
        .to_string(),
    )
}

/// A coordinator, a worker and `supervisors` supervisors; waits until memory answers.
async fn services(
    llm: &OpenAiServer,
    explore: u8,
    supervisors: usize,
) -> anyhow::Result<Processes> {
    let mut p = Processes::start(&config(&llm.base_url(), explore)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    for _ in 0..supervisors {
        p.spawn(&["supervisor"])?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while p.client.call(&list_request(), ASK).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "memory never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(p)
}

fn list_request() -> MemoryListRequest {
    MemoryListRequest {
        protocol: 1,
        session_id: None,
        limit: None,
    }
}

/// Submits a bare query (retrying while the coordinator has not seen the planner's worker)
/// and waits for the run to succeed.
async fn run_query(p: &Processes, query: &str) -> anyhow::Result<RunId> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let run = loop {
        let reply = p
            .client
            .submit_request(&SubmitRequest::query(query), ASK)
            .await?;
        if reply
            .errors
            .iter()
            .any(|e| e.code == ProblemCode::NoPlanner)
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        anyhow::ensure!(reply.status == SubmitStatus::Accepted, "{reply:?}");
        break reply.run_id.expect("run id");
    };
    let outcome = p.client.wait(run, WAIT).await?;
    anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
    Ok(run)
}

/// The run's entry, once the supervisor has written it.
async fn remembered(p: &Processes, run: RunId) -> anyhow::Result<MemoryEntry> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = MemoryGetRequest {
            protocol: 1,
            run_id: run,
        };
        if let Ok(Ok(e)) = p.client.call(&r, ASK).await {
            return Ok(e);
        }
        anyhow::ensure!(Instant::now() < deadline, "run {run} was never remembered");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What the run recorded about memory, from its record.
async fn memory_of(p: &Processes, run: RunId) -> anyhow::Result<MemoryUse> {
    let view = p.client.run(run).await?.expect("run view");
    view.record
        .memory
        .ok_or_else(|| anyhow::anyhow!("run {run} records no memory use"))
}

/// The memory use on the run's `run_started` event.
async fn started_memory(p: &Processes, run: RunId) -> anyhow::Result<Option<MemoryUse>> {
    let stored = p
        .bus
        .direct_batch(
            StreamKind::Events,
            &format!("flotilla.event.{run}"),
            0,
            100,
            None,
        )
        .await?;
    for m in stored {
        for e in decode_events(flotilla_bus::wire::codec_of(Some(&m.headers)), &m.payload)? {
            if let Event::Workflow(w) = e.event
                && w.phase == WorkflowPhase::RunStarted
            {
                return Ok(w.memory.map(|m| *m));
            }
        }
    }
    anyhow::bail!("run {run} has no run_started event")
}

/// Messages in the memory bucket's stream (one per write, history 1).
async fn memory_writes(p: &Processes) -> anyhow::Result<u64> {
    Ok(p.bus
        .js()
        .get_stream("KV_flotilla-memory")
        .await?
        .info()
        .await?
        .state
        .messages)
}

#[tokio::test]
async fn a_run_is_remembered_once_and_a_similar_query_reuses_its_plan() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(plan_reply().when("_plan-1"));
    // Two supervisor replicas share the event stream.
    let p = services(&llm, 0, 2).await?;

    let first = run_query(
        &p,
        "Summarise the quarterly revenue report for ACME Corporation",
    )
    .await?;
    let entry = remembered(&p, first).await?;
    assert_eq!(
        entry.query,
        "Summarise the quarterly revenue report for ACME Corporation"
    );
    assert_eq!(entry.query_source, QuerySource::Query);
    assert_eq!(entry.outcome, RunStatus::Succeeded);
    let ids: Vec<&str> = entry.plan.subtasks.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["research", "report"]);
    assert_eq!(entry.team.roles, ["researcher", "synthesis"]);
    assert!(!entry.truncated && entry.reused_from.is_none());
    // The first run had no memory to use: it says so.
    let used = memory_of(&p, first).await?;
    assert_eq!(
        (used.decision, used.reason),
        (MemoryDecision::Planner, MemoryReason::NoMatch)
    );
    assert_eq!(llm.requests().len(), 1);

    // A child run of a tree is not remembered.
    let mut child = SubmitRequest::new(plan(vec![flotilla_model::plan::Subtask::new(
        "c",
        "child work",
    )]));
    child.parent = Some(RunHandle::root(first));
    let child_run = p.client.submit(child).await?;
    let outcome = p.client.wait(child_run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");

    // A similar query (5 of 6 words: confidence 0.833): the plan is reused, the planner is
    // not called.
    let second = run_query(&p, "Summarise the quarterly revenue report of ACME Inc").await?;
    assert_eq!(llm.requests().len(), 1, "the planner was called again");
    let used = memory_of(&p, second).await?;
    assert_eq!(used.decision, MemoryDecision::Reused);
    assert_eq!(used.reason, MemoryReason::AboveThreshold);
    assert_eq!(used.source_run, Some(first));
    assert_eq!(used.confidence, Some(0.833));
    assert_eq!(used.measure, "cosine-words-v1");
    let view = p.client.run(second).await?.expect("view");
    assert!(view.record.planning.is_none(), "{:?}", view.record);
    assert_eq!(view.tasks.len(), 2);
    // The `run_started` event (shown by `flotilla watch`'s user profile) says so too.
    let on_event = started_memory(&p, second)
        .await?
        .expect("memory on run_started");
    assert_eq!(on_event.source_run, Some(first));
    let out = p.cli(&["watch", &second.to_string()])?;
    let watched = String::from_utf8_lossy(&out.stdout);
    assert!(
        watched.contains(&format!(
            "run_started (plan reused from run {first} (confidence 0.833"
        )),
        "{watched}"
    );
    let reused = remembered(&p, second).await?;
    assert_eq!(reused.reused_from, Some(first));

    // Every root run once: two replicas, and no child entry.
    let list: MemoryList = p.client.request(&list_request(), ASK).await?;
    let listed: Vec<RunId> = list.entries.iter().map(|e| e.run_id).collect();
    assert_eq!(listed, [second, first], "newest first, no child");
    assert_eq!(memory_writes(&p).await?, 2);

    // The end of the first run delivered again (as after a replica died before acknowledging
    // it): the same event message, stored once more, is handled again and records nothing.
    let stored = p
        .bus
        .direct_batch(
            StreamKind::Events,
            &format!("flotilla.event.{first}"),
            0,
            1000,
            None,
        )
        .await?;
    let end = stored
        .into_iter()
        .find(|m| {
            decode_events(flotilla_bus::wire::codec_of(Some(&m.headers)), &m.payload)
                .is_ok_and(|es| {
                    es.iter().any(|e| {
                        matches!(&e.event, Event::Workflow(w) if w.phase == WorkflowPhase::RunSucceeded)
                    })
                })
        })
        .expect("the first run's end");
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in end.headers.iter() {
        if name.to_string() != "Nats-Msg-Id" {
            for v in values {
                headers.append(name.to_string(), v.to_string());
            }
        }
    }
    p.bus
        .js()
        .publish_with_headers(end.subject.clone(), headers, end.payload.clone())
        .await?
        .await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut c = p
            .bus
            .js()
            .get_stream("FLOTILLA_EVENTS")
            .await?
            .get_consumer::<async_nats::jetstream::consumer::pull::Config>(
                flotilla_supervisor::CONSUMER,
            )
            .await
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let info = c.info().await?.clone();
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the supervisors never caught up: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        memory_writes(&p).await?,
        2,
        "a redelivered end was recorded again"
    );
    assert_eq!(remembered(&p, first).await?, entry);
    Ok(())
}

/// What a run spent is remembered from its budget entry; a run without a budget of its own
/// has none to read (and its entry says nothing was counted, not zero).
#[tokio::test]
async fn a_run_with_a_budget_is_remembered_with_what_it_spent() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push_all([Reply::text("the figures"), Reply::text("the figures")]);
    let p = services(&llm, 0, 1).await?;
    let mut runs = Vec::new();
    for budget in [Some(100_000), None] {
        let mut plan = flotilla_model::plan::Plan::empty();
        let mut task = flotilla_model::plan::Subtask::new("figures", "Find the figures.");
        task.agent = Some("writer".into());
        plan.subtasks.push(task);
        plan.config.max_tokens = budget;
        let run = p.client.submit(SubmitRequest::new(plan)).await?;
        let outcome = p.client.wait(run, WAIT).await?;
        anyhow::ensure!(outcome.status == RunStatus::Succeeded, "{outcome:?}");
        runs.push(run);
    }
    let with = remembered(&p, runs[0]).await?;
    assert!(with.tokens.is_some_and(|t| t > 0), "{with:?}");
    let without = remembered(&p, runs[1]).await?;
    assert_eq!(without.tokens, None, "{without:?}");
    Ok(())
}

#[tokio::test]
async fn dissimilar_queries_and_exploring_runs_call_the_planner() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    for _ in 0..4 {
        llm.push(plan_reply().when("_plan-1"));
    }
    // Every run explores.
    let p = services(&llm, 100, 1).await?;
    let query = "Summarise the quarterly revenue report for ACME Corporation";
    let first = run_query(&p, query).await?;
    remembered(&p, first).await?;

    // The same query again: above the threshold, but exploring calls the planner, with the
    // match as its example.
    let again = run_query(&p, query).await?;
    assert_eq!(llm.requests().len(), 2);
    let used = memory_of(&p, again).await?;
    assert_eq!(
        (used.decision, used.reason),
        (MemoryDecision::Planner, MemoryReason::Explore)
    );
    assert_eq!(used.source_run, Some(first));
    assert_eq!(used.confidence, Some(1.0));
    let asked = llm.requests()[1].user();
    assert!(asked.contains("\"examples\""), "{asked}");
    assert!(asked.contains("Find the quarter's figures."), "{asked}");
    assert!(asked.contains("confidence"), "{asked}");

    // Some words in common: below the threshold, the planner gets examples.
    let near = run_query(&p, "Compare the quarterly revenue of Globex").await?;
    assert_eq!(llm.requests().len(), 3);
    let used = memory_of(&p, near).await?;
    assert_eq!(
        (used.decision, used.reason),
        (MemoryDecision::Planner, MemoryReason::BelowThreshold)
    );
    assert!(!used.examples.is_empty() && used.examples.len() <= 3);
    assert!(used.confidence.is_some_and(|c| c < 0.8), "{used:?}");
    assert!(llm.requests()[2].user().contains("\"examples\""));

    // Nothing in common: the planner, without examples.
    let far = run_query(&p, "Write a poem about autumn leaves").await?;
    assert_eq!(llm.requests().len(), 4);
    let used = memory_of(&p, far).await?;
    assert_eq!(used.reason, MemoryReason::NoMatch);
    assert!(used.examples.is_empty());
    assert!(!llm.requests()[3].user().contains("\"examples\""));
    Ok(())
}

/// An API refusal of `request`.
async fn refused<R: flotilla_model::api::ApiRequest>(
    p: &Processes,
    request: &R,
) -> anyhow::Result<ApiError> {
    match p.client.call(request, ASK).await? {
        Ok(_) => anyhow::bail!("{} was answered", R::ENDPOINT),
        Err(e) => Ok(e),
    }
}

#[tokio::test]
async fn forget_removes_an_entry_and_bad_input_changes_nothing() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push(plan_reply().when("_plan-1"));
    let p = services(&llm, 0, 1).await?;
    let run = run_query(&p, "Summarise the quarterly revenue report for ACME").await?;
    remembered(&p, run).await?;
    let before: MemoryList = p.client.request(&list_request(), ASK).await?;
    let writes = memory_writes(&p).await?;

    // Unknown runs: structured 404s.
    let unknown = RunId::new();
    let e = refused(
        &p,
        &MemoryForgetRequest {
            protocol: 1,
            run_id: unknown,
        },
    )
    .await?;
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"), "{e:?}");
    assert!(e.message.contains(&unknown.to_string()), "{e:?}");
    let e = refused(
        &p,
        &MemoryGetRequest {
            protocol: 1,
            run_id: unknown,
        },
    )
    .await?;
    assert_eq!(e.code, "not_found");
    // A bad limit, and a session that is not a session id.
    let e = refused(
        &p,
        &MemoryListRequest {
            protocol: 1,
            session_id: None,
            limit: Some(0),
        },
    )
    .await?;
    assert_eq!((e.status, e.code.as_str()), (400, "invalid"), "{e:?}");
    let answer = p
        .bus
        .client()
        .request(
            "flotilla.api.memory.list",
            r#"{"protocol":1,"session_id":"not a session"}"#.into(),
        )
        .await?;
    let e: ApiError = serde_json::from_slice(&answer.payload)?;
    assert_eq!((e.status, e.code.as_str()), (400, "malformed"), "{e:?}");
    // The CLI says it too, with exit 1.
    let out = p.cli(&["memory", "forget", &unknown.to_string()])?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not_found"));
    let out = p.cli(&["memory", "list", "--session", "nope"])?;
    assert!(!out.status.success());
    // Nothing changed.
    let after: MemoryList = p.client.request(&list_request(), ASK).await?;
    assert_eq!(after, before);
    assert_eq!(memory_writes(&p).await?, writes);

    // The CLI lists and shows it.
    let out = p.cli(&["memory", "list"])?;
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && listed.contains(&run.to_string()),
        "{listed}"
    );
    let out = p.cli(&["memory", "show", &run.to_string()])?;
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        shown.contains("research [researcher]: Find the quarter's figures."),
        "{shown}"
    );
    assert!(
        shown.contains("report [synthesis] after research"),
        "{shown}"
    );

    // Forgotten: gone from get and list, and not recorded again.
    let out = p.cli(&["memory", "forget", &run.to_string(), "--json"])?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let e = refused(
        &p,
        &MemoryGetRequest {
            protocol: 1,
            run_id: run,
        },
    )
    .await?;
    assert_eq!(e.code, "not_found");
    let after: MemoryList = p.client.request(&list_request(), ASK).await?;
    assert!(after.entries.is_empty(), "{after:?}");
    let e = refused(
        &p,
        &MemoryForgetRequest {
            protocol: 1,
            run_id: run,
        },
    )
    .await?;
    assert_eq!(e.code, "not_found", "forgetting twice");
    Ok(())
}

/// The lookup a bare query pays, over a bucket holding more than the scan limit: 1,200
/// entries of a realistic size (a query, four subtasks); the scan reads the newest 1,000 and
/// scores them. Prints the time (`--no-capture` shows it); bounded generously so a loaded
/// machine does not fail it, while a scan of the whole bucket or one read per key would.
#[tokio::test]
async fn a_lookup_reads_the_newest_thousand_entries_once() -> anyhow::Result<()> {
    use flotilla_model::memory::{MemoryEntry, memory_key};
    use flotilla_model::subjects::Bucket;
    let server = flotilla_testkit::NatsServer::start().await?;
    let bus = server.provisioned_bus().await?;
    let kv = bus.kv(Bucket::Memory).await?;
    let mut plan = flotilla_model::plan::Plan::empty();
    for (i, d) in [
        "Find the figures.",
        "Compare with last year.",
        "Check the sources.",
        "Write the report.",
    ]
    .iter()
    .enumerate()
    {
        plan.subtasks
            .push(flotilla_model::plan::Subtask::new(&format!("t{i}"), d));
    }
    let (shape, team) = MemoryEntry::shape_of(&plan);
    for i in 0..1200 {
        let run = RunId::new();
        let e = MemoryEntry {
            run_id: run,
            session_id: None,
            query: format!("Summarise the quarterly revenue report number {i} for customer {i}"),
            query_source: QuerySource::Query,
            name: None,
            plan: shape.clone(),
            team: team.clone(),
            outcome: RunStatus::Succeeded,
            cause: None,
            duration_ms: 1000,
            tokens: Some(1234),
            cost_usd: None,
            created_at: flotilla_model::time::Timestamp::now(),
            finished_at: flotilla_model::time::Timestamp::now(),
            recorded_at: flotilla_model::time::Timestamp::now(),
            reused_from: None,
            truncated: false,
        };
        kv.create(memory_key(run), serde_json::to_vec(&e)?.into())
            .await?;
    }
    let memory = flotilla_coordinator::memory::Memory::new(
        bus.clone(),
        flotilla_coordinator::memory::MemoryOptions::default(),
    );
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let entries = memory.newest().await?;
        assert_eq!(entries.len(), 1000);
        let advice = flotilla_coordinator::memory::decide(
            RunId::new(),
            "Summarise the quarterly revenue report for ACME",
            None,
            &entries,
            &flotilla_coordinator::memory::MemoryOptions::default(),
            |p| Ok((p.clone(), Vec::new())),
        );
        assert!(matches!(
            advice,
            flotilla_coordinator::memory::Advice::Plan { .. }
        ));
        times.push(t.elapsed());
    }
    times.sort();
    eprintln!(
        "memory lookup over 1000 of 1200 entries: median {:?}, min {:?}, max {:?}",
        times[2], times[0], times[4]
    );
    assert!(times[2] < Duration::from_secs(2), "{times:?}");
    Ok(())
}
