//! A question an external agent asks mid-call (`query`, the protocol's frame for a permission
//! request), put to a person as a Flotilla approval instead of being left to the agent's
//! default (deny):
//!
//! ```text
//!  query ─► approval.ask (run, task, attempt, agent, question, deadline)
//!        ─► the approval pending in the escalations bucket: approval.list, the console's
//!           inbox and the notices show it; a person answers with approval.answer
//!        ─► ask again every 500 ms until it is settled: answered, or past its deadline (the
//!           coordinator then settles it expired: reject, unless an answer came first)
//!        ─► publish the answer on the query's reply_subject: approve "yes", respond its
//!           text, reject / expired / withdrawn "no"
//! ```
//!
//! Only a call made by a running attempt can ask (the approval belongs to its run, task and
//! attempt); a call from an operator's shell leaves the question to the agent's default.

use std::time::Duration;

use flotilla_client::Client;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::approval::{
    ApprovalAskRequest, ApprovalRecord, ApprovalStatus, external_reply,
};
use flotilla_model::ids::{RunId, TaskId};

use crate::wire::Query;

/// The attempt a call is made by: whose run a question becomes an approval of.
#[derive(Clone)]
pub struct Asker {
    /// The client the approval is asked with (the API).
    pub client: Client,
    /// The calling run.
    pub run_id: RunId,
    /// The calling task.
    pub task_id: TaskId,
    /// The calling attempt.
    pub attempt: u32,
    /// The calling attempt's id (its envelope's).
    pub attempt_id: flotilla_model::ids::AttemptId,
    /// The agent called (`agents:<agent>.<owner>.<session>`).
    pub agent: String,
    /// What it was asked (the person's context).
    pub context: String,
    /// When the call ends (its timeout). A person has 90 % of what is left of it when the
    /// question comes (at least 1 s, at most an hour): unanswered, the agent still hears
    /// `no` before the call ends, and can finish.
    pub call_ends: tokio::time::Instant,
}

impl std::fmt::Debug for Asker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Asker")
            .field("run_id", &self.run_id)
            .field("task_id", &self.task_id)
            .field("attempt", &self.attempt)
            .field("agent", &self.agent)
            .field("call_ends", &self.call_ends)
            .finish_non_exhaustive()
    }
}

/// How a question was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Asked {
    /// The approval's id in the calling run.
    pub approval_id: String,
    /// How it was settled (`decided`, `expired`, `withdrawn`).
    pub status: ApprovalStatus,
    /// What the agent is told (`yes`, `no`, or a person's text).
    pub reply: String,
}

/// How long one `approval.ask` request may take.
const ASK_WAIT: Duration = Duration::from_secs(10);

fn protocol_error(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

/// Puts `query` to a person (see the module's docs) and answers the agent on its
/// `reply_subject`. An error (the coordinator refused, NATS failed) leaves the question
/// unanswered — the agent's default, deny, applies — and says why.
pub async fn ask_and_answer(asker: &Asker, query: &Query) -> Result<Asked, String> {
    let request = ApprovalAskRequest {
        protocol: PROTOCOL_VERSION,
        run_id: asker.run_id,
        task_id: asker.task_id.clone(),
        attempt: asker.attempt,
        attempt_id: asker.attempt_id,
        agent: asker.agent.clone(),
        query_id: query.id.clone(),
        question: query.prompt.clone(),
        context: asker.context.clone(),
        timeout_s: Some(
            asker
                .call_ends
                .saturating_duration_since(tokio::time::Instant::now())
                .mul_f64(0.9)
                .as_secs()
                .clamp(1, flotilla_model::approval::MAX_ASK_TIMEOUT_S),
        ),
    };
    let record = ask(&asker.client, &request).await?;
    let record = match external_reply(&record) {
        Some(_) => record,
        None => wait_settled(&asker.client, &request, record).await?,
    };
    let reply = external_reply(&record).unwrap_or_else(|| "no".to_owned());
    asker
        .client
        .bus()
        .client()
        .publish(query.reply_subject.clone(), reply.clone().into())
        .await
        .map_err(|e| protocol_error("answering the agent's query", e))?;
    let _ = asker.client.bus().client().flush().await;
    Ok(Asked {
        approval_id: record.request.approval_id,
        status: record.status,
        reply,
    })
}

async fn ask(client: &Client, request: &ApprovalAskRequest) -> Result<ApprovalRecord, String> {
    match client.call(request, ASK_WAIT).await {
        Ok(Ok(reply)) => Ok(reply.record),
        Ok(Err(e)) => Err(format!("approval.ask refused: {} {}", e.code, e.message)),
        Err(e) => Err(protocol_error("approval.ask", e)),
    }
}

/// How often a waiting caller asks again. Through the API, not a watch of the escalations
/// bucket: workers' NATS permissions (deploy/nats/accounts.conf) reach the API, not that
/// bucket. A person's decision reaches the agent within this.
const POLL: Duration = Duration::from_millis(500);

/// Asks again (the same approval) until it is settled: answered, or past its deadline, when
/// the coordinator settles it expired. The coordinator's clock decides the deadline; a limit
/// of our own (the deadline plus a minute) keeps a coordinator that never settles it from
/// holding the call forever.
async fn wait_settled(
    client: &Client,
    request: &ApprovalAskRequest,
    pending: ApprovalRecord,
) -> Result<ApprovalRecord, String> {
    let left = pending
        .request
        .deadline
        .unix_ms()
        .saturating_sub(flotilla_model::time::Timestamp::now().unix_ms())
        .max(0) as u64;
    let give_up =
        tokio::time::Instant::now() + Duration::from_millis(left) + Duration::from_secs(60);
    loop {
        tokio::time::sleep(POLL).await;
        let record = ask(client, request).await?;
        if record.status != ApprovalStatus::Pending {
            return Ok(record);
        }
        if tokio::time::Instant::now() >= give_up {
            return Err("the approval stayed pending past its deadline".to_owned());
        }
    }
}
