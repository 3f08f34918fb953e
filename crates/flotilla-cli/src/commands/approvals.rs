//! `flotilla approvals list|show|approve|reject|edit|respond|history|grants|revoke`: the
//! operator's inbox of tasks waiting for a person (`<prefix>.api.approval.*`, served by the
//! coordinator), and the tools approved for a session (`approve --always`).
//! `list --watch` follows `<prefix>.notify.*.*` and lists again on each notice.
//! Exit 0 done, 1 refused (`already_decided` — another answer or the deadline decided
//! first, or the approval was withdrawn because its run stopped waiting; it prints which —, `not_found`, also for `list --run` and `history` of a
//! run that does not exist, `digest_mismatch`, a malformed answer), 2 no coordinator.

use std::process::ExitCode;

use flotilla_model::approval::{
    AnswerOutcome, ApprovalAnswerReply, ApprovalAnswerRequest, ApprovalGetRequest, ApprovalList,
    ApprovalListRequest, ApprovalRecord, ApprovalStatus, ApprovalView, Decision, GrantList,
    GrantListRequest, GrantRevokeReply, GrantRevokeRequest,
};
use flotilla_model::ids::{RunId, SessionId};
use futures::StreamExt;

use super::team::{answer, answer_with, connect};
use crate::config::Config;

/// `flotilla approvals`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum ApprovalsCommand {
    /// Pending approvals across runs (or of one run), oldest first.
    List {
        /// Only this run's.
        #[arg(long)]
        run: Option<RunId>,
        /// Settled ones too.
        #[arg(long)]
        all: bool,
        /// Keep listing as requests arrive (until Ctrl-C).
        #[arg(long)]
        watch: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// One approval: what is asked, the digest, its deadline and default, and its history.
    Show {
        /// The run.
        run: RunId,
        /// The approval (`t<task>a<attempt>`).
        approval: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Every approval of a run with who answered, when, and how (its audit trail).
    History {
        /// The run.
        run: RunId,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Let the task (or tool call) run as asked.
    Approve {
        #[command(flatten)]
        args: AnswerArgs,
        /// For a tool call: approve the tool for the rest of the run's session (its later
        /// calls run without asking until `approvals revoke`).
        #[arg(long)]
        always: bool,
    },
    /// The tools approved for a session (`approve --always`).
    Grants {
        /// A run of the session.
        #[arg(long, conflicts_with = "session", required_unless_present = "session")]
        run: Option<RunId>,
        /// The session.
        #[arg(long)]
        session: Option<SessionId>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Withdraw a tool's approval for a session: its next call waits for a person again.
    Revoke {
        /// The tool.
        tool: String,
        /// A run of the session.
        #[arg(long, conflicts_with = "session", required_unless_present = "session")]
        run: Option<RunId>,
        /// The session.
        #[arg(long)]
        session: Option<SessionId>,
        /// Who revokes it (default: `$USER`, else your operating-system user name).
        #[arg(long)]
        by: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Do not run the task (a required task fails the run; an optional one is skipped).
    Reject {
        #[command(flatten)]
        args: AnswerArgs,
        /// Why (shown in the run's outcome).
        #[arg(long, default_value = "")]
        message: String,
        /// Record the rejection as an incident of the task's agent (and role): its trust
        /// drops to novice at once, as with `flotilla trust incident`.
        #[arg(long)]
        incident: bool,
    },
    /// Run the task with this input instead (JSON).
    Edit {
        #[command(flatten)]
        args: AnswerArgs,
        /// The input, as JSON.
        #[arg(long)]
        input: String,
    },
    /// Do not run the task: this is its result.
    Respond {
        #[command(flatten)]
        args: AnswerArgs,
        /// The result.
        #[arg(long)]
        result: String,
    },
}

/// What every answer names.
#[derive(Debug, clap::Args)]
pub(crate) struct AnswerArgs {
    /// The run.
    run: RunId,
    /// The approval (`t<task>a<attempt>`).
    approval: String,
    /// Who answers (default: `$USER`, else your operating-system user name).
    #[arg(long)]
    by: Option<String>,
    /// A comment for the record.
    #[arg(long)]
    comment: Option<String>,
    /// The digest of the request you reviewed (`approvals show`): refused if it changed.
    #[arg(long)]
    digest: Option<String>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn approvals(
    config: &Config,
    command: ApprovalsCommand,
) -> anyhow::Result<ExitCode> {
    let client = connect(config).await?;
    let protocol = flotilla_model::PROTOCOL_VERSION;
    let (args, decision, always, incident) = match command {
        ApprovalsCommand::List {
            run,
            all,
            watch,
            json,
        } => {
            if let Some(run) = run
                && let Some(code) = unknown_run(&client, run, json).await?
            {
                return Ok(code);
            }
            let r = ApprovalListRequest {
                protocol,
                run_id: run,
                all,
                limit: None,
            };
            if !watch {
                return answer(&client, &r, json, print_list).await;
            }
            // Approvals, questions and client tools each have their notice kind.
            let prefix = client.bus().names().prefix();
            let filter = match run {
                Some(run) => format!("{prefix}.notify.*.{run}"),
                None => format!("{prefix}.notify.*.*"),
            };
            let mut notices = client.bus().client().subscribe(filter).await?;
            loop {
                let code = answer(&client, &r, json, print_list).await?;
                if code != ExitCode::SUCCESS {
                    return Ok(code);
                }
                tokio::select! {
                    n = notices.next() => if n.is_none() { return Ok(ExitCode::SUCCESS) },
                    _ = tokio::signal::ctrl_c() => return Ok(ExitCode::SUCCESS),
                }
            }
        }
        ApprovalsCommand::Show {
            run,
            approval,
            json,
        } => {
            let r = ApprovalGetRequest {
                protocol,
                run_id: run,
                approval_id: approval,
            };
            return answer(&client, &r, json, print_view).await;
        }
        ApprovalsCommand::History { run, json } => {
            if let Some(code) = unknown_run(&client, run, json).await? {
                return Ok(code);
            }
            let r = ApprovalListRequest {
                protocol,
                run_id: Some(run),
                all: true,
                limit: None,
            };
            return answer(&client, &r, json, print_history).await;
        }
        ApprovalsCommand::Grants { run, session, json } => {
            let r = GrantListRequest {
                protocol,
                run_id: run,
                session_id: session,
            };
            return answer(&client, &r, json, print_grants).await;
        }
        ApprovalsCommand::Revoke {
            tool,
            run,
            session,
            by,
            json,
        } => {
            let r = GrantRevokeRequest {
                protocol,
                run_id: run,
                session_id: session,
                tool,
                by: super::person(by)?,
            };
            return answer(&client, &r, json, |a: &GrantRevokeReply| {
                let g = &a.revoked;
                outln!(
                    "revoked: {} (approved by {} in run {} at {})",
                    g.tool,
                    g.by,
                    g.run_id,
                    g.at
                )
            })
            .await;
        }
        ApprovalsCommand::Approve { args, always } => (args, Decision::Approve, always, false),
        ApprovalsCommand::Reject {
            args,
            message,
            incident,
        } => (args, Decision::Reject { message }, false, incident),
        ApprovalsCommand::Edit { args, input } => {
            let input = serde_json::from_str(&input)
                .map_err(|e| anyhow::anyhow!("--input is not JSON: {e}"))?;
            (args, Decision::Edit { input }, false, false)
        }
        ApprovalsCommand::Respond { args, result } => {
            (args, Decision::Respond { result }, false, false)
        }
    };
    let by = super::person(args.by)?;
    let r = ApprovalAnswerRequest {
        protocol,
        run_id: args.run,
        approval_id: args.approval,
        decision,
        by,
        comment: args.comment,
        digest: args.digest,
        always,
        incident,
    };
    answer_with(
        &client,
        &r,
        args.json,
        |a: &ApprovalAnswerReply| match a.outcome {
            AnswerOutcome::Decided => outln!("{}", settled_line(&a.record)),
            AnswerOutcome::AlreadyDecided => {
                errln!("already_decided: {}", settled_line(&a.record))
            }
        },
        // An answer that lost to an earlier one decided nothing.
        |a: &ApprovalAnswerReply| match a.outcome {
            AnswerOutcome::Decided => ExitCode::SUCCESS,
            AnswerOutcome::AlreadyDecided => ExitCode::FAILURE,
        },
    )
    .await
}

/// `--run RUN` of a run that does not exist is `not_found` (exit 1), printed as an API
/// refusal is, rather than an empty list that looks like a run with nothing waiting.
async fn unknown_run(
    client: &flotilla_client::Client,
    run: RunId,
    json: bool,
) -> anyhow::Result<Option<ExitCode>> {
    let store = flotilla_client::open_store(client.bus()).await?;
    if store.record(run).await?.is_some() {
        return Ok(None);
    }
    let message = format!("run {run} does not exist");
    if json {
        let out = serde_json::json!({"error": "not_found", "message": message});
        outln!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        errln!("error: not_found: {message}");
    }
    Ok(Some(ExitCode::from(1)))
}

pub(crate) fn settled_line(r: &ApprovalRecord) -> String {
    match &r.answer {
        // Nobody decided: the run stopped waiting (it ended, or its task was completed by
        // hand), and the rejection's message says why.
        Some(a) if r.status == ApprovalStatus::Withdrawn => {
            let why = match &a.decision {
                Decision::Reject { message } if !message.is_empty() => format!(": {message}"),
                _ => String::new(),
            };
            format!("withdrawn at {}{why}; nothing waits for an answer", a.at)
        }
        Some(a) => {
            let mut line = format!(
                "{} {} by {} at {}",
                r.status.as_str(),
                a.decision.as_str(),
                a.by,
                a.at
            );
            if let Some(c) = &a.comment {
                line.push_str(&format!(" ({c})"));
            }
            if a.always {
                line.push_str(" — the tool is approved for the session");
            }
            line
        }
        None => r.status.as_str().to_owned(),
    }
}

fn print_grants(l: &GrantList) {
    if l.grants.is_empty() {
        outln!("no tools approved for session {}", l.session_id);
        return;
    }
    outln!(
        "{:<24}  {:<16}  {:<36}  {:<9}  AT",
        "TOOL",
        "BY",
        "RUN",
        "APPROVAL"
    );
    for g in &l.grants {
        outln!(
            "{:<24}  {:<16}  {:<36}  {:<9}  {}",
            g.tool,
            g.by,
            g.run_id,
            g.approval_id,
            g.at
        );
    }
}

fn print_list(l: &ApprovalList) {
    if l.approvals.is_empty() {
        outln!("no approvals waiting");
        return;
    }
    outln!(
        "{:<36}  {:<9}  {:<16}  {:<16}  {:<9}  DEADLINE",
        "RUN",
        "APPROVAL",
        "TASK",
        "TRIGGER",
        "STATUS"
    );
    for r in &l.approvals {
        let q = &r.request;
        outln!(
            "{:<36}  {:<9}  {:<16}  {:<16}  {:<9}  {}",
            q.run_id,
            q.approval_id,
            q.task_id,
            q.trigger.as_str(),
            r.status.as_str(),
            q.deadline
        );
    }
    if l.truncated {
        outln!("(more not listed)");
    }
}

fn print_view(v: &ApprovalView) {
    let q = &v.record.request;
    outln!("approval {} of run {}", q.approval_id, q.run_id);
    outln!("  task      {} (attempt {})", q.task_id, q.attempt);
    outln!("  trigger   {} ({})", q.trigger.as_str(), q.mode.as_str());
    if let Some(a) = &q.action {
        outln!("  action    {a} (risk {:?})", q.risk);
    }
    if let Some(a) = &q.agent {
        outln!("  agent     {a}");
    }
    outln!("  asks      {}", q.description);
    if !q.input.is_null() {
        outln!("  input     {}", q.input);
    }
    outln!("  digest    {}", q.digest);
    outln!("  deadline  {} (then {:?})", q.deadline, q.default);
    outln!("  status    {}", settled_line(&v.record));
    for h in &v.history {
        outln!(
            "  rev {:<4} {}  {}{}",
            h.revision,
            h.at,
            h.status.as_str(),
            h.answer
                .as_ref()
                .filter(|_| h.status != ApprovalStatus::Withdrawn)
                .map(|a| format!(" {} by {}", a.decision.as_str(), a.by))
                .unwrap_or_default()
        );
    }
}

fn print_history(l: &ApprovalList) {
    if l.approvals.is_empty() {
        outln!("no approvals");
        return;
    }
    for r in &l.approvals {
        let q = &r.request;
        outln!(
            "{}  {} {} (attempt {}), {}: asked {}, {}",
            q.approval_id,
            q.task_id,
            q.action.as_deref().unwrap_or("-"),
            q.attempt,
            q.trigger.as_str(),
            q.requested_at,
            settled_line(r)
        );
    }
}
