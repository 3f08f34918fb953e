//! Workflow agents (`sequential`, `parallel`, `loop`) end to end: `flotilla coordinator`
//! processes drive them (their embedded worker of the `_workflow` pool), every sub-agent
//! execution is a child run on `flotilla worker` processes. The sub-agents are deterministic
//! test agents — `scripted` replies and small Python `exec` agents — not models.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use flotilla_client::Client;
use flotilla_context::{Clients, Scope};
use flotilla_model::RunId;
use flotilla_model::event::{Event, WorkflowPhase};
use flotilla_model::plan::Subtask;
use flotilla_model::run::{RunOutcome, RunStatus};
use flotilla_model::submit::SubmitRequest;
use futures::StreamExt;
use serde_json::{Value, json};
use support::*;

/// Prints a JSON reply computed from the task envelope on stdin.
fn py(expr: &str) -> String {
    let code = format!(
        "import json, sys; t = json.load(sys.stdin); i = t.get('input') or {{}}; prev = i.get('previous_results') or []; print({expr})"
    );
    format!(
        "kind = \"exec\"\ncommand = \"python3\"\nargs = [\"-c\", {}]\n",
        serde_json::to_string(&code).expect("json string")
    )
}

fn agents() -> String {
    format!(
        r#"
# Generator–critic as a sequential pipeline; the draft also goes to session state.
[agents.review]
kind = "sequential"
sub-agents = ["drafter", "critic"]
output-keys = {{ drafter = "draft" }}

[agents.drafter]
kind = "scripted"
reply = "draft of: {{description}}"

[agents.critic]
{critic}
# Fan-out / gather.
[agents.survey]
kind = "parallel"
sub-agents = ["web", "papers"]

[agents.web]
kind = "scripted"
reply = "web says yes"

[agents.papers]
kind = "scripted"
reply = "papers say maybe"
delay = "200ms"

# Iterative refinement: writer, then judge, until the judge escalates.
[agents.refine]
kind = "loop"
sub-agents = ["writer", "judge"]
max-iterations = 5

[agents.writer]
{writer}
[agents.judge]
{judge}
# Hierarchical: a sequential whose first step is itself a parallel workflow.
[agents.study]
kind = "sequential"
sub-agents = ["sources", "summarizer"]

[agents.sources]
kind = "parallel"
sub-agents = ["source_a", "source_b"]

[agents.source_a]
kind = "scripted"
reply = "fact A"

[agents.source_b]
kind = "scripted"
reply = "fact B"

[agents.summarizer]
{summarizer}
"#,
        critic = py("'critique of [' + prev[-1]['response'] + ']'"),
        writer = py("'version %d' % i['iteration']"),
        judge = py("json.dumps({'escalate': i['iteration'] >= 2, 'judged': prev[-1]['response']})"),
        summarizer = py("'summary of ' + prev[-1]['response']"),
    )
}

/// The runs `run`'s tasks started (from its `agent_run_started` events), recursively.
async fn descendants(client: &Client, run: RunId) -> anyhow::Result<Vec<RunId>> {
    let mut found = Vec::new();
    let mut queue = vec![run];
    while let Some(r) = queue.pop() {
        let mut seen = BTreeSet::new();
        let events = client.events(r).await?;
        futures::pin_mut!(events);
        // The run has ended: read what its stream holds, then stop at the end event.
        let read = async {
            while let Some(e) = events.next().await {
                match e?.event {
                    Event::AgentRunStarted { child } if seen.insert(child.run_id) => {
                        found.push(child.run_id);
                        queue.push(child.run_id);
                    }
                    Event::Workflow(w) if w.phase.ends_run() => break,
                    _ => {}
                }
            }
            Ok::<_, anyhow::Error>(())
        };
        tokio::time::timeout(WAIT, read).await??;
    }
    Ok(found)
}

async fn run_one(
    p: &Processes,
    agent: &str,
    description: &str,
) -> anyhow::Result<(RunId, RunOutcome)> {
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("main", description).with_agent(agent),
        ])))
        .await?;
    let outcome = p.client.wait(run, WAIT).await?;
    Ok((run, outcome))
}

fn response(outcome: &RunOutcome) -> String {
    outcome
        .final_result
        .as_ref()
        .map(|f| f.response.clone())
        .unwrap_or_default()
}

/// One worker with a single slot runs every pattern: the workflows themselves wait on the
/// coordinator, so they never take the slot their children need.
#[tokio::test]
async fn sequential_parallel_loop_and_nested_workflows_run_as_child_runs() -> anyhow::Result<()> {
    let mut p = Processes::start(&agents()).await?;
    p.coordinator().await?;
    p.worker(&["--concurrency", "1"]).await?;

    // Generator–critic (sequential): the critic sees the draft; the draft is in state.
    let (run, outcome) = run_one(&p, "review", "the launch plan").await?;
    assert_eq!(
        outcome.status,
        RunStatus::Succeeded,
        "{outcome:?}\n{}",
        p.log(0)
    );
    assert_eq!(
        response(&outcome),
        "critique of [draft of: the launch plan]"
    );
    assert_eq!(descendants(&p.client, run).await?.len(), 2);
    let operator = Clients::new(
        p.bus.clone(),
        Scope::operator(p.bus.names().clone(), run, run, run.to_string()),
    )?;
    let draft = operator
        .state()
        .get("draft")
        .await?
        .expect("output key written");
    assert_eq!(draft.value, json!("draft of: the launch plan"));

    // Fan-out / gather (parallel): both branches, by sub-agent.
    let (run, outcome) = run_one(&p, "survey", "is it true?").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let gathered: Value = serde_json::from_str(&response(&outcome))?;
    assert_eq!(
        gathered,
        json!({"web": "web says yes", "papers": "papers say maybe"})
    );
    assert_eq!(descendants(&p.client, run).await?.len(), 2);

    // Iterative refinement (loop): the judge escalates in iteration 2 of 5.
    let (run, outcome) = run_one(&p, "refine", "improve the text").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let last: Value = serde_json::from_str(&response(&outcome))?;
    assert_eq!(last, json!({"escalate": true, "judged": "version 2"}));
    assert_eq!(
        descendants(&p.client, run).await?.len(),
        4,
        "two iterations of writer and judge, then the loop stopped"
    );

    // Hierarchical (nested workflows): a parallel step inside a sequential one.
    let (run, outcome) = run_one(&p, "study", "the market").await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let summary = response(&outcome);
    assert!(
        summary.starts_with("summary of ")
            && summary.contains("fact A")
            && summary.contains("fact B"),
        "{summary}"
    );
    assert_eq!(
        descendants(&p.client, run).await?.len(),
        4,
        "sources and summarizer, and the two sources' children"
    );
    Ok(())
}

/// Slow loop steps; the coordinator driving the loop is killed after the first child started
/// and a new coordinator takes over: the loop finishes, and no step ran twice.
#[tokio::test]
async fn a_loop_survives_its_coordinator_being_killed() -> anyhow::Result<()> {
    let slow = agents().replace(
        "[agents.writer]\n",
        "[agents.writer]\n# slow: the coordinator dies while it runs\n",
    );
    let slow = slow.replace(
        "print('version %d' % i['iteration'])",
        "__import__('time').sleep(1); print('version %d' % i['iteration'])",
    );
    let mut p = Processes::start(&slow).await?;
    let first = p.coordinator().await?;
    p.worker(&["--concurrency", "2"]).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("main", "improve").with_agent("refine"),
        ])))
        .await?;
    // Wait for the first child run, then kill the coordinator.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            if matches!(e?.event, Event::AgentRunStarted { .. }) {
                return Ok::<_, anyhow::Error>(());
            }
        }
        anyhow::bail!("event stream ended")
    })
    .await??;
    p.kill(first);
    p.coordinator().await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let last: Value = serde_json::from_str(&response(&outcome))?;
    assert_eq!(last["judged"], json!("version 2"));
    assert_eq!(
        descendants(&p.client, run).await?.len(),
        4,
        "the redelivered workflow re-attached to its children instead of starting them again"
    );
    // The workflow task started twice, on the two coordinators' embedded workers.
    let events = p.client.events(run).await?;
    futures::pin_mut!(events);
    let mut starters = BTreeSet::new();
    tokio::time::timeout(WAIT, async {
        while let Some(e) = events.next().await {
            match e?.event {
                Event::Workflow(w) if w.phase == WorkflowPhase::TaskStarted => {
                    starters.insert(w.worker.unwrap_or_default());
                }
                Event::Workflow(w) if w.phase.ends_run() => break,
                _ => {}
            }
        }
        Ok::<_, anyhow::Error>(())
    })
    .await??;
    assert_eq!(starters.len(), 2, "{starters:?}");
    Ok(())
}

#[tokio::test]
async fn a_workflow_tree_with_problems_stops_the_coordinator_naming_them() -> anyhow::Result<()> {
    let extra = r#"
[agents.one]
kind = "sequential"
sub-agents = ["two", "leaf"]

[agents.two]
kind = "loop"
sub-agents = ["one"]
max-iterations = 0

[agents.other]
kind = "parallel"
sub-agents = ["leaf", "ghost"]

[agents.leaf]
kind = "scripted"
"#;
    let mut p = Processes::start(extra).await?;
    let i = p.spawn(&["coordinator"])?;
    let code = p.wait_exit(i, Duration::from_secs(20)).await?;
    assert_ne!(code, Some(0));
    let log = p.log(i);
    for needle in [
        "agents.one: workflows contain each other: one → two → one",
        "agents.two.max-iterations: must be at least 1",
        "agents.other.sub-agents: \"leaf\" already belongs to workflow \"one\"",
        "agents.other.sub-agents: \"ghost\" is not defined under [agents]",
    ] {
        assert!(log.contains(needle), "{needle:?} not in:\n{log}");
    }
    Ok(())
}

#[tokio::test]
async fn a_failing_sub_agent_fails_the_workflow_with_its_child_named() -> anyhow::Result<()> {
    let extra = r#"
[agents.pipeline]
kind = "sequential"
sub-agents = ["ok_step", "bad_step"]

[agents.ok_step]
kind = "scripted"

[agents.bad_step]
kind = "exec"
command = "sh"
args = ["-c", "echo broken >&2; exit 3"]
"#;
    let mut p = Processes::start(extra).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    let mut plan = plan(vec![Subtask::new("main", "x").with_agent("pipeline")]);
    plan.config.max_retries = 0;
    let run = p.client.submit(SubmitRequest::new(plan)).await?;
    let outcome = p.client.wait(run, WAIT).await?;
    assert_eq!(outcome.status, RunStatus::Failed, "{outcome:?}");
    let message = &outcome.failed[0].error.message;
    assert!(
        message.contains("sub-agent bad_step (child run") && message.contains("broken"),
        "{message}"
    );
    Ok(())
}
