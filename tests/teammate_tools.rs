//! The LLM teammate tools across processes against a real nats-server: an LLM agent spawns a
//! persistent teammate, messages it (the teammate runs a turn on a worker), broadcasts, lists
//! its team and shuts the teammate down, all in its run's team; refusals of the supervisor
//! (a duplicate name, an unknown agent, mail to a teammate shutting down) come back to the
//! model as tool errors naming the code and change nothing; without a supervisor the tools
//! answer `no_supervisor`.
//!
//! Agents are deterministic: the model is the OpenAI-compatible test double
//! (`flotilla_testkit::openai`, scripted tool calls), and the teammate is an exec script
//! (`python3`) answering with its session key and each new message's sender and text.

mod support;

use std::time::Duration;

use flotilla_model::plan::Subtask;
use flotilla_model::run::RunStatus;
use flotilla_model::subjects::Bucket;
use flotilla_model::submit::SubmitRequest;
use flotilla_model::teammate::{
    TeamMates, TeamMatesRequest, TeamSendRequest, TeamSpawnRequest, Teammate, TeammateStatus,
    TeammateView,
};
use flotilla_testkit::openai::{OpenAiServer, Reply};
use serde_json::json;
use support::*;

const ASK: Duration = Duration::from_secs(10);

/// Every teammate tool.
const TOOLS: [&str; 5] = [
    "spawn_teammate",
    "send_message",
    "broadcast",
    "list_team",
    "shutdown_teammate",
];

fn config(base_url: &str, supervisor: bool) -> String {
    format!(
        r#"
default-agent = "mate"

[agents.mate]
kind = "exec"
command = "python3"
args = ["-c", '''
import json, sys, os
i = json.load(sys.stdin)['input']
print('session=%s; ' % os.environ.get('FLOTILLA_SESSION_ID') + '; '.join('%s says %s' % (m['from'], m['text']) for m in i['messages']))
''']
roles = ["analyst"]

[agents.lead-llm]
kind = "llm"
base-url = "{base_url}"
model = "scripted-model"
max-tool-rounds = 12
tools = ["spawn_teammate", "send_message", "broadcast", "list_team", "shutdown_teammate"]

{supervisor}
"#,
        supervisor = if supervisor {
            "[supervisor]\nack-wait = \"2s\""
        } else {
            ""
        }
    )
}

/// Starts a coordinator, a worker and (when asked) a supervisor answering the team API.
async fn services(base_url: &str, supervisor: bool) -> anyhow::Result<Processes> {
    let mut p = Processes::start(&config(base_url, supervisor)).await?;
    p.coordinator().await?;
    p.worker(&[]).await?;
    if supervisor {
        let i = p.spawn(&["supervisor"])?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while p.client.request(&mates(None), ASK).await.is_err() {
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "the supervisor never answered:\n{}",
                p.log(i)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(p)
}

fn mates(team: Option<&str>) -> TeamMatesRequest {
    TeamMatesRequest {
        protocol: 1,
        team: team.map(str::to_owned),
    }
}

async fn team_of(p: &Processes, team: &str) -> anyhow::Result<Vec<TeammateView>> {
    let list: TeamMates = p.client.request(&mates(Some(team)), ASK).await?;
    Ok(list.teammates)
}

/// Waits until `pred` holds for teammate `name` of `team`.
async fn until(
    p: &Processes,
    team: &str,
    name: &str,
    pred: impl Fn(&TeammateView) -> bool,
) -> anyhow::Result<TeammateView> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let m = team_of(p, team)
            .await?
            .into_iter()
            .find(|m| m.name == name)
            .ok_or_else(|| anyhow::anyhow!("no teammate {name} in team {team}"))?;
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

/// The tool results the model was given, in order (from its last request).
fn tool_results(llm: &OpenAiServer) -> Vec<String> {
    let requests = llm.requests();
    requests
        .last()
        .map(|r| {
            r.messages()
                .iter()
                .filter(|m| m["role"] == "tool")
                .filter_map(|m| m["content"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn an_llm_agent_runs_a_team_of_teammates_with_its_tools() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push_all([
        Reply::tool_call(
            "spawn_teammate",
            json!({"name": "ann", "role": "analyst", "instructions": "answer briefly"}),
        ),
        // Refused: the name is taken.
        Reply::tool_call(
            "spawn_teammate",
            json!({"name": "ann", "role": "analyst", "instructions": "something else"}),
        ),
        // Refused: no such agent definition.
        Reply::tool_call(
            "spawn_teammate",
            json!({"name": "bob", "role": "analyst", "instructions": "check", "agent": "nope"}),
        ),
        Reply::tool_call("send_message", json!({"to": "ann", "text": "hello"})),
        Reply::tool_call("broadcast", json!({"text": "all hands"})),
        Reply::tool_call("list_team", json!({})),
        Reply::tool_call("shutdown_teammate", json!({"name": "ann"})),
        // Refused: ann is shut down (or shutting down after its turn).
        Reply::tool_call("send_message", json!({"to": "ann", "text": "too late"})),
        Reply::text("The team did its work."),
    ]);
    let p = services(&llm.base_url(), true).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("lead", "build a team").with_agent("lead-llm"),
        ])))
        .await?;
    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");

    let requests = llm.requests();
    assert_eq!(requests.len(), 9, "one request per scripted reply");
    let mut offered = requests[0].tool_names();
    offered.sort();
    let mut all = TOOLS.map(str::to_owned).to_vec();
    all.sort();
    assert_eq!(offered, all, "the opt-in tools listed, and only them");

    // The team is the run's session key: the root run id (no session id was given).
    let team = run.to_string();
    let results = tool_results(&llm);
    assert_eq!(results.len(), 8, "{results:?}");
    let result =
        |i: usize| -> anyhow::Result<serde_json::Value> { Ok(serde_json::from_str(&results[i])?) };
    let spawned = result(0)?;
    assert_eq!(spawned["name"], "ann", "{spawned}");
    assert_eq!(spawned["team"], team.as_str());
    assert_eq!(spawned["agent"], "mate", "the member filling the role");
    assert_eq!(spawned["status"], "spawned");
    assert_eq!(
        result(1)?["error"]["code"],
        "duplicate_name",
        "{}",
        results[1]
    );
    assert_eq!(
        result(2)?["error"]["code"],
        "unknown_agent",
        "{}",
        results[2]
    );
    assert!(
        result(2)?["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("nope")),
        "{}",
        results[2]
    );
    assert_eq!(result(3)?["delivered"], json!(["ann"]), "{}", results[3]);
    assert_eq!(result(4)?["delivered"], json!(["ann"]), "{}", results[4]);
    let listed = result(5)?;
    assert_eq!(listed["team"], team.as_str(), "{listed}");
    let names: Vec<&str> = listed["teammates"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(names, ["ann"], "{listed}");
    assert_eq!(listed["teammates"][0]["role"], "analyst");
    let shut = result(6)?;
    assert_eq!(shut["name"], "ann", "{shut}");
    assert!(
        shut["status"] == "shutdown" || shut["shutdown_requested"] == true,
        "{shut}"
    );
    assert_eq!(result(7)?["error"]["code"], "shut_down", "{}", results[7]);

    // The teammate ran its turns — the messages came from the lead's task id, in the run's
    // team — and is shut down after them.
    let ann = until(&p, &team, "ann", |m| m.status == TeammateStatus::Shutdown).await?;
    assert!(ann.turns >= 1, "{ann:?}");
    assert_eq!(ann.turns_failed, 0, "{ann:?}");
    let reply = ann.last_reply.clone().unwrap_or_default();
    assert!(reply.contains(&format!("session={team}")), "{reply}");
    assert!(reply.contains("lead says"), "{reply}");

    // The refusals changed nothing: ann is still the first spawn's, and there is no bob.
    let all = team_of(&p, &team).await?;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(
        (all[0].role.as_str(), all[0].agent.as_str()),
        ("analyst", "mate")
    );
    let kv = p.bus.kv(Bucket::Team).await?;
    let entry = kv
        .get(flotilla_model::teammate::teammate_key(&team, "ann"))
        .await?
        .ok_or_else(|| anyhow::anyhow!("no entry"))?;
    let entry: Teammate = serde_json::from_slice(&entry)?;
    assert_eq!(entry.instructions, "answer briefly");
    assert_eq!(
        entry.spawned_by.as_deref(),
        Some("lead"),
        "the spawning task"
    );
    assert!(
        kv.get(flotilla_model::teammate::teammate_key(&team, "bob"))
            .await?
            .is_none()
    );
    Ok(())
}

#[tokio::test]
async fn a_teammate_turn_acts_in_its_own_team() -> anyhow::Result<()> {
    // A team that is not a session id: the turn's session key (what `flotilla team ...` and
    // the teammate tools take as the team) is still the team, not a fresh run id.
    let llm = OpenAiServer::start().await?;
    let p = services(&llm.base_url(), true).await?;
    p.client
        .request(
            &TeamSpawnRequest {
                protocol: 1,
                team: Some("t1".into()),
                name: "cid".into(),
                role: "analyst".into(),
                instructions: "answer".into(),
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
            &TeamSendRequest {
                protocol: 1,
                team: Some("t1".into()),
                to: "cid".into(),
                from: Some("dana".into()),
                text: "hi".into(),
            },
            ASK,
        )
        .await?;
    let cid = until(&p, "t1", "cid", |m| m.turns == 1).await?;
    assert_eq!(
        cid.last_reply.as_deref(),
        Some("session=t1; dana says hi"),
        "{cid:?}"
    );
    Ok(())
}

#[tokio::test]
async fn without_a_supervisor_the_tools_say_so() -> anyhow::Result<()> {
    let llm = OpenAiServer::start().await?;
    llm.push_all([
        Reply::tool_call(
            "spawn_teammate",
            json!({"name": "ann", "role": "analyst", "instructions": "answer"}),
        ),
        Reply::tool_call("list_team", json!({})),
        Reply::text("Working alone."),
    ]);
    let p = services(&llm.base_url(), false).await?;
    let run = p
        .client
        .submit(SubmitRequest::new(plan(vec![
            Subtask::new("lead", "build a team").with_agent("lead-llm"),
        ])))
        .await?;
    let outcome = p.client.wait(run, Duration::from_secs(60)).await?;
    assert_eq!(outcome.status, RunStatus::Succeeded, "{outcome:?}");
    let results = tool_results(&llm);
    assert_eq!(results.len(), 2, "{results:?}");
    for r in &results {
        let v: serde_json::Value = serde_json::from_str(r)?;
        assert_eq!(v["error"]["code"], "no_supervisor", "{r}");
    }
    Ok(())
}
