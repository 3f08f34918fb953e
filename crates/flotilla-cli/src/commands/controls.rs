//! `flotilla runs pause|resume|takeover|complete|answer`: a person's hand on a running run
//! (or, with `--task`, on one of its tasks)
//! (`<prefix>.api.run.pause|resume|takeover|complete`, and `approval.answer` for an
//! agent's question, served by the coordinator). Exit 0 done (also when the run was already
//! in the asked state), 1 refused (`not_found`, `task_not_pending`, bad input, a question
//! answered already), 2 no coordinator.

use std::process::ExitCode;
use std::time::Duration;

use flotilla_model::control::{
    CompleteTaskReply, CompleteTaskRequest, ControlRunReply, EditPlanReply, EditPlanRequest,
    PauseRunRequest, ResumeRunRequest, TakeoverContext, TakeoverRunRequest,
};
use flotilla_model::ids::{RunId, TaskId};

use super::team::{answer, connect};
use super::{caller, person};
use crate::config::Config;

/// The run-control commands of `flotilla runs`.
#[derive(Debug, clap::Subcommand)]
pub(crate) enum ControlCommand {
    /// Hold a run: nothing new is dispatched (running attempts finish); its child runs pause
    /// too. It resumes by itself after --for (default 24h). With --task, only that task
    /// (a member) pauses: it is not dispatched, its running LLM attempt stops at its next
    /// step, and the rest of the run goes on.
    Pause {
        run: RunId,
        #[command(flatten)]
        args: ControlArgs,
        /// How long the pause lasts before it resumes by itself (1s to 7d).
        #[arg(long = "for", value_parser = humantime::parse_duration)]
        hold: Option<Duration>,
        /// Pause this task alone.
        #[arg(long)]
        task: Option<TaskId>,
    },
    /// Continue a paused or taken-over run where it stopped (its child runs too); with
    /// --task, a task paused by itself.
    Resume {
        run: RunId,
        #[command(flatten)]
        args: ControlArgs,
        /// Resume this task, paused by itself (`runs pause --task`).
        #[arg(long)]
        task: Option<TaskId>,
    },
    /// Take a run over: the agents dispatch nothing; prints where the run stands (completed
    /// and pending tasks, results, the suggested next step). Then `runs complete`, `runs
    /// resume` or `runs cancel`. Cancelled by itself after --for (default 24h).
    Takeover {
        run: RunId,
        #[command(flatten)]
        args: ControlArgs,
        /// How long you hold the run before it is cancelled (1s to 7d).
        #[arg(long = "for", value_parser = humantime::parse_duration)]
        hold: Option<Duration>,
    },
    /// Complete a task by hand: your result stands as the task's and its dependents get it.
    Complete {
        run: RunId,
        task: TaskId,
        /// The result.
        #[arg(long)]
        result: String,
        /// Who completes it (default: $USER, else your operating-system user name).
        #[arg(long)]
        by: Option<String>,
        /// Why.
        #[arg(long)]
        comment: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Edit the remaining plan of a run you took over: PLAN is the whole plan as it should
    /// run from here — every task of the run kept at its position, started tasks unchanged,
    /// waiting tasks as you want them, new tasks at the end (`flotilla runs show RUN --json`
    /// has the current one). Checked like a submission; then `runs resume` hands it back.
    Edit {
        run: RunId,
        /// The edited plan file (.json, or .msgpack).
        #[arg(long)]
        plan: std::path::PathBuf,
        /// Who edits (default: $USER, else your operating-system user name).
        #[arg(long)]
        by: Option<String>,
        /// Why.
        #[arg(long)]
        reason: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Answer an agent's question (`ask_user`) or a tool call waiting for a person: the text
    /// is the tool's result the agent continues with. TOKEN is the request's approval id
    /// (`t<task>a<attempt>c<n>`, from the run's events or `approvals list`). A second
    /// answer is refused (`already_decided`, exit 1).
    Answer {
        run: RunId,
        token: String,
        /// The answer.
        #[arg(long)]
        text: String,
        /// Who answers (default: $USER, else your operating-system user name).
        #[arg(long)]
        by: Option<String>,
        /// A comment for the record.
        #[arg(long)]
        comment: Option<String>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

/// What every pause, resume and takeover takes.
#[derive(Debug, clap::Args)]
pub(crate) struct ControlArgs {
    /// Why (recorded in the run's events).
    #[arg(long)]
    reason: Option<String>,
    /// Who asks (default: $USER, else your operating-system user name).
    #[arg(long)]
    by: Option<String>,
    /// Leave the run's child runs as they are.
    #[arg(long)]
    no_children: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn ms(d: Option<Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) async fn control(config: &Config, command: ControlCommand) -> anyhow::Result<ExitCode> {
    let client = connect(config).await?;
    let protocol = flotilla_model::PROTOCOL_VERSION;
    match command {
        ControlCommand::Pause {
            run,
            args,
            hold,
            task,
        } => {
            let r = PauseRunRequest {
                protocol,
                run_id: run,
                reason: args.reason,
                by: caller(args.by),
                timeout_ms: ms(hold),
                children: !args.no_children && task.is_none(),
                task_id: task,
            };
            answer(&client, &r, args.json, |a| print_control(a, "paused")).await
        }
        ControlCommand::Resume { run, args, task } => {
            let r = ResumeRunRequest {
                protocol,
                run_id: run,
                reason: args.reason,
                by: caller(args.by),
                children: !args.no_children && task.is_none(),
                task_id: task,
            };
            answer(&client, &r, args.json, |a| print_control(a, "resumed")).await
        }
        ControlCommand::Takeover { run, args, hold } => {
            let r = TakeoverRunRequest {
                protocol,
                run_id: run,
                reason: args.reason,
                by: caller(args.by),
                timeout_ms: ms(hold),
                children: !args.no_children,
            };
            answer(&client, &r, args.json, |a| {
                print_control(a, "taken over");
                if let Some(c) = &a.context {
                    print_context(c);
                }
            })
            .await
        }
        ControlCommand::Complete {
            run,
            task,
            result,
            by,
            comment,
            json,
        } => {
            let r = CompleteTaskRequest {
                protocol,
                run_id: run,
                task_id: task,
                result,
                by: person(by)?,
                comment,
            };
            answer(&client, &r, json, |a: &CompleteTaskReply| {
                outln!(
                    "Task {} of run {} completed by hand; its dependents get your result",
                    a.task_id,
                    a.run_id
                );
            })
            .await
        }
        ControlCommand::Edit {
            run,
            plan,
            by,
            reason,
            json,
        } => {
            let plan = match super::plan::read_plan(&plan, &config.validation_context())? {
                Ok(p) => p,
                Err(report) => {
                    for p in &report.errors {
                        errln!("error: {p}");
                    }
                    return Ok(ExitCode::from(1));
                }
            };
            let r = EditPlanRequest {
                protocol,
                run_id: run,
                plan,
                by: person(by)?,
                reason,
            };
            answer(&client, &r, json, |a: &EditPlanReply| {
                outln!(
                    "Plan of run {} edited: {} tasks, {} added{}; resume the run to hand it back",
                    a.run_id,
                    a.tasks_total,
                    a.added,
                    if a.changed.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ", changed: {}",
                            a.changed
                                .iter()
                                .map(ToString::to_string)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    }
                );
            })
            .await
        }
        ControlCommand::Answer {
            run,
            token,
            text,
            by,
            comment,
            json,
        } => {
            let r = flotilla_model::approval::ApprovalAnswerRequest {
                protocol,
                run_id: run,
                approval_id: token,
                decision: flotilla_model::approval::Decision::Respond { result: text },
                by: person(by)?,
                comment,
                digest: None,
                always: false,
                incident: false,
            };
            use flotilla_model::approval::{AnswerOutcome, ApprovalAnswerReply};
            let refused = std::cell::Cell::new(false);
            let code = answer(&client, &r, json, |a: &ApprovalAnswerReply| {
                let line = super::approvals::settled_line(&a.record);
                match a.outcome {
                    AnswerOutcome::Decided => outln!("answered: {line}"),
                    AnswerOutcome::AlreadyDecided => {
                        refused.set(true);
                        errln!("already_decided: {line}");
                    }
                }
            })
            .await?;
            Ok(if refused.get() {
                ExitCode::from(1)
            } else {
                code
            })
        }
    }
}

/// The answer to a pause, resume or takeover: what the run machine made of it (`detail`
/// says why nothing changed, or that no coordinator applied it yet).
fn print_control(a: &ControlRunReply, what: &str) {
    let why = |fallback: String| a.detail.clone().unwrap_or(fallback);
    if let Some(task) = &a.task_id {
        let action = if what == "paused" { "pause" } else { "resume" };
        if a.pending {
            outln!(
                "The {action} of task {task} of run {} is recorded: {}",
                a.run_id,
                why("it applies once a coordinator gets to it".into())
            );
        } else if a.applied {
            outln!("Task {task} of run {} {what}", a.run_id);
        } else {
            outln!(
                "Task {task} of run {}: nothing changed: {}",
                a.run_id,
                why(format!("the run is {}", a.status))
            );
        }
        return;
    }
    if a.pending {
        outln!(
            "Run {}: recorded, not applied yet: {}",
            a.run_id,
            why("it applies once a coordinator gets to it".into())
        );
    } else if a.applied {
        outln!("Run {} {what} (it was {})", a.run_id, a.status);
    } else {
        outln!(
            "Run {}: nothing changed: {}",
            a.run_id,
            why(format!("it is {}", a.status))
        );
    }
    if !a.children.is_empty() {
        outln!("  and {} child run(s):", a.children.len());
        for c in &a.children {
            outln!("    {c}");
        }
    }
}

fn print_context(c: &TakeoverContext) {
    outln!(
        "\nStep {} of {} tasks ended.  Next: {}",
        c.step,
        c.tasks_total,
        c.suggested_next.detail
    );
    if let Some(reason) = &c.failure_reason {
        outln!("Failure: {reason}");
    }
    if !c.completed.is_empty() {
        outln!("\nCompleted:");
        for t in &c.completed {
            let mut preview: String = t.result.chars().take(100).collect();
            if preview.len() < t.result.len() || t.truncated {
                preview.push('…');
            }
            outln!(
                "  {:<24} by {:<20} {}",
                t.task_id.as_str(),
                t.by,
                preview.replace('\n', " ")
            );
        }
    }
    if !c.pending.is_empty() {
        outln!("\nPending:");
        for t in &c.pending {
            let waiting = if t.ready {
                "ready".to_owned()
            } else if t.waiting_on.is_empty() {
                String::new()
            } else {
                format!(
                    "waiting on {}",
                    t.waiting_on
                        .iter()
                        .map(|d| d.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            outln!(
                "  {:<24} {:<18} {waiting}",
                t.task_id.as_str(),
                t.status.as_str()
            );
        }
    }
    if !c.failed.is_empty() {
        outln!("\nFailed:");
        for t in &c.failed {
            outln!("  {:<24} {}", t.task_id.as_str(), t.error);
        }
    }
    if c.omitted > 0 {
        outln!("\n({} more tasks not listed)", c.omitted);
    }
}
