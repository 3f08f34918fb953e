//! Who is acting, and on which run tree and session: the scope of every context operation.
//!
//! A [`Scope`] is built three ways, and is the same value each time:
//!
//! * by the worker for each attempt, from the task envelope ([`Scope::from_envelope`]);
//! * by an exec agent's `flotilla ws|mbox|state|artifacts` commands, from the environment the
//!   worker set ([`Scope::from_env`], the inverse of [`Scope::to_env`]);
//! * by an operator's commands, from `--run` ([`Scope::operator`]).
//!
//! The scope pins identity: workspace writes record it as the writer, mailbox posts carry its
//! task id in the subject's `from` token, and per-attempt message ids make a redelivered
//! attempt's writes idempotent.

use flotilla_model::ids::{AttemptId, RunId, TaskId};
use flotilla_model::plan::DataflowValidation;
use flotilla_model::subjects::Names;
use flotilla_model::task::{TaskEnvelope, TraceContext};
use flotilla_model::token::{check_name, normalize_topic};
use flotilla_model::workspace::Writer;

use crate::error::{ContextError, ErrorKind};

/// `FLOTILLA_NATS_URL`: the worker's NATS server URLs, comma separated.
pub const ENV_NATS_URL: &str = "FLOTILLA_NATS_URL";
/// `FLOTILLA_NATS_USER`: user name, with [`ENV_NATS_PASSWORD`].
pub const ENV_NATS_USER: &str = "FLOTILLA_NATS_USER";
/// `FLOTILLA_NATS_PASSWORD`: password, with [`ENV_NATS_USER`].
pub const ENV_NATS_PASSWORD: &str = "FLOTILLA_NATS_PASSWORD";
/// `FLOTILLA_NATS_TOKEN`: an authentication token.
pub const ENV_NATS_TOKEN: &str = "FLOTILLA_NATS_TOKEN";
/// `FLOTILLA_NATS_CREDS`: path of a `.creds` file.
pub const ENV_NATS_CREDS: &str = "FLOTILLA_NATS_CREDS";
/// `FLOTILLA_NATS_NKEY`: an NKey seed.
pub const ENV_NATS_NKEY: &str = "FLOTILLA_NATS_NKEY";
/// `FLOTILLA_RUN_ID`: the run of the attempt.
pub const ENV_RUN_ID: &str = "FLOTILLA_RUN_ID";
/// `FLOTILLA_ROOT_RUN_ID`: the root of its run tree (whose workspace and mailboxes it shares).
pub const ENV_ROOT_RUN_ID: &str = "FLOTILLA_ROOT_RUN_ID";
/// `FLOTILLA_TASK_ID`: the task (the agent's mailbox address).
pub const ENV_TASK_ID: &str = "FLOTILLA_TASK_ID";
/// `FLOTILLA_ATTEMPT`: 1 for the first attempt, 2 for the first retry, …
pub const ENV_ATTEMPT: &str = "FLOTILLA_ATTEMPT";
/// `FLOTILLA_ATTEMPT_ID`: the attempt's unique id (idempotency of its writes).
pub const ENV_ATTEMPT_ID: &str = "FLOTILLA_ATTEMPT_ID";
/// `FLOTILLA_DELIVERY`: which delivery of the attempt's task message runs (1, 2 … after a
/// worker died).
pub const ENV_DELIVERY: &str = "FLOTILLA_DELIVERY";
/// `FLOTILLA_SESSION_ID`: the session key of session state (the session id, else the root
/// run id).
pub const ENV_SESSION_ID: &str = "FLOTILLA_SESSION_ID";
/// `FLOTILLA_PREFIX`: the installation's subject prefix.
pub const ENV_PREFIX: &str = "FLOTILLA_PREFIX";
/// `FLOTILLA_PRODUCES`: the topics the task declares, comma separated (unset: unrestricted).
pub const ENV_PRODUCES: &str = "FLOTILLA_PRODUCES";
/// `FLOTILLA_DATAFLOW`: `strict` or `lenient`.
pub const ENV_DATAFLOW: &str = "FLOTILLA_DATAFLOW";
/// `FLOTILLA_ROLE`: the task's team role (it reads the messages sent to `role:<name>`).
pub const ENV_ROLE: &str = "FLOTILLA_ROLE";

/// `TRACEPARENT`: the W3C trace context of the attempt (the OpenTelemetry convention for
/// passing it through the environment), so the child runs an exec agent starts with
/// `flotilla call` join the attempt's trace.
pub const ENV_TRACEPARENT: &str = "TRACEPARENT";
/// `TRACESTATE`: the W3C `tracestate` going with [`ENV_TRACEPARENT`].
pub const ENV_TRACESTATE: &str = "TRACESTATE";

/// Writer name of operator writes (the CLI outside a task).
pub const OPERATOR: &str = "operator";

/// The run tree, session and identity an agent (or operator) acts in.
#[derive(Debug, Clone, PartialEq)]
pub struct Scope {
    /// Subject, stream and bucket names of the installation.
    pub names: Names,
    /// The run.
    pub run_id: RunId,
    /// The root of its run tree: whose workspace and mailboxes are used.
    pub root_run_id: RunId,
    /// The session key of session state: the session id, else the root run id.
    pub session: String,
    /// The task acting (its mailbox address); `None` for an operator not acting as a task.
    pub task_id: Option<TaskId>,
    /// The task's attempt number.
    pub attempt: Option<u32>,
    /// The attempt's id: writes carry message ids derived from it, so a redelivered attempt
    /// does not duplicate them.
    pub attempt_id: Option<AttemptId>,
    /// Which delivery of the attempt's task message is running.
    pub delivery: Option<i64>,
    /// The topics the task declares it writes (`None`: unrestricted, as for operators).
    pub produces: Option<Vec<String>>,
    /// Under `strict`, a task may write only the topics in `produces`.
    pub dataflow: DataflowValidation,
    /// Writer name outside a task (`operator`, or a client's name).
    pub by: Option<String>,
    /// The attempt's trace context (the envelope's `trace`): child runs started in this scope
    /// carry it to the coordinator, so they join the run's trace.
    pub trace: Option<TraceContext>,
    /// The task's team role, when it names one that is a valid name: the task reads the
    /// mailbox messages sent to `role:<name>`, each claimed by the first such reader.
    pub role: Option<String>,
}

fn invalid_scope(message: String) -> ContextError {
    ContextError::new(ErrorKind::InvalidScope, message)
}

/// Checks a session key: it becomes the first token of KV keys.
fn check_session(session: &str) -> Result<(), ContextError> {
    check_name(session).map_err(|e| invalid_scope(format!("session {session:?} {e}")))
}

impl Scope {
    /// The scope of one delivery of a task attempt.
    pub fn from_envelope(task: &TaskEnvelope, delivery: i64, names: Names) -> Self {
        Self {
            names,
            run_id: task.run_id,
            root_run_id: task.root_run(),
            session: task.session(),
            task_id: Some(task.task_id.clone()),
            attempt: Some(task.attempt),
            attempt_id: Some(task.attempt_id),
            delivery: Some(delivery),
            produces: Some(task.produces.iter().map(|t| normalize_topic(t)).collect()),
            dataflow: task.dataflow_validation,
            by: None,
            trace: task.trace.clone(),
            role: task.role.clone().filter(|r| check_name(r).is_ok()),
        }
    }

    /// An operator's scope on a run: unrestricted topics, no task identity (give one with
    /// [`with_task`](Self::with_task) to read or send mail as that task).
    pub fn operator(names: Names, run_id: RunId, root_run_id: RunId, session: String) -> Self {
        Self {
            names,
            run_id,
            root_run_id,
            session,
            task_id: None,
            attempt: None,
            attempt_id: None,
            delivery: None,
            produces: None,
            dataflow: DataflowValidation::Lenient,
            by: Some(OPERATOR.to_owned()),
            trace: None,
            role: None,
        }
    }

    /// Acts as `task` (mailbox address, writer task).
    pub fn with_task(mut self, task: TaskId) -> Self {
        self.task_id = Some(task);
        self
    }

    /// Gives the scope a team role: its reads then claim the messages sent to
    /// `role:<role>`.
    pub fn with_role(mut self, role: impl Into<String>) -> Self {
        self.role = Some(role.into());
        self
    }

    /// Names the writer outside a task.
    pub fn with_by(mut self, by: impl Into<String>) -> Self {
        self.by = Some(by.into());
        self
    }

    /// The scope an exec agent's environment describes (see [`to_env`](Self::to_env)).
    pub fn from_env() -> Result<Self, ContextError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) over any variable lookup. `FLOTILLA_RUN_ID` is required;
    /// the root defaults to the run, the session to the root, the prefix to `flotilla`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, ContextError> {
        let get = |name: &str| var(name).map(|v| v.trim().to_owned());
        let nonempty = |name: &str| get(name).filter(|v| !v.is_empty());
        let prefix = nonempty(ENV_PREFIX)
            .unwrap_or_else(|| flotilla_model::subjects::DEFAULT_PREFIX.to_owned());
        let names = Names::new(&prefix)
            .map_err(|e| invalid_scope(format!("{ENV_PREFIX}={prefix:?} {e}")))?;
        let run_id: RunId = nonempty(ENV_RUN_ID)
            .ok_or_else(|| {
                invalid_scope(format!(
                    "{ENV_RUN_ID} is not set: pass --run RUN, or run inside an exec agent"
                ))
            })?
            .parse()
            .map_err(|e| invalid_scope(format!("{ENV_RUN_ID}: {e}")))?;
        let root_run_id = match nonempty(ENV_ROOT_RUN_ID) {
            Some(r) => r
                .parse()
                .map_err(|e| invalid_scope(format!("{ENV_ROOT_RUN_ID}: {e}")))?,
            None => run_id,
        };
        let session = nonempty(ENV_SESSION_ID).unwrap_or_else(|| root_run_id.to_string());
        check_session(&session)?;
        let task_id = nonempty(ENV_TASK_ID).map(TaskId::new);
        let attempt = nonempty(ENV_ATTEMPT)
            .map(|a| {
                a.parse::<u32>()
                    .map_err(|_| invalid_scope(format!("{ENV_ATTEMPT}={a:?} is not a number")))
            })
            .transpose()?;
        let attempt_id = nonempty(ENV_ATTEMPT_ID)
            .map(|a| {
                a.parse::<AttemptId>()
                    .map_err(|e| invalid_scope(format!("{ENV_ATTEMPT_ID}: {e}")))
            })
            .transpose()?;
        let delivery = nonempty(ENV_DELIVERY)
            .map(|d| {
                d.parse::<i64>()
                    .map_err(|_| invalid_scope(format!("{ENV_DELIVERY}={d:?} is not a number")))
            })
            .transpose()?;
        // Set but empty: the task declares no topics (strict: it may write none).
        let produces = get(ENV_PRODUCES).map(|p| {
            p.split(',')
                .map(normalize_topic)
                .filter(|t| !t.is_empty())
                .collect::<Vec<_>>()
        });
        let dataflow = match nonempty(ENV_DATAFLOW).as_deref() {
            None | Some("strict") => DataflowValidation::Strict,
            Some("lenient") => DataflowValidation::Lenient,
            Some(other) => {
                return Err(invalid_scope(format!(
                    "{ENV_DATAFLOW}={other:?}: expected strict or lenient"
                )));
            }
        };
        // A malformed context is dropped here as everywhere: it never breaks a call.
        let trace = nonempty(ENV_TRACEPARENT)
            .filter(|tp| tp.split('-').count() == 4)
            .map(|traceparent| TraceContext {
                traceparent,
                tracestate: nonempty(ENV_TRACESTATE),
            });
        let role = nonempty(ENV_ROLE).filter(|r| check_name(r).is_ok());
        Ok(Self {
            names,
            run_id,
            root_run_id,
            session,
            by: task_id.is_none().then(|| OPERATOR.to_owned()),
            task_id,
            attempt,
            attempt_id,
            delivery,
            produces,
            dataflow,
            trace,
            role,
        })
    }

    /// The environment describing this scope to an exec agent (without the connection
    /// variables: see [`crate::connection_env`]).
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            (ENV_PREFIX, self.names.prefix().to_owned()),
            (ENV_RUN_ID, self.run_id.to_string()),
            (ENV_ROOT_RUN_ID, self.root_run_id.to_string()),
            (ENV_SESSION_ID, self.session.clone()),
        ];
        if let Some(t) = &self.task_id {
            env.push((ENV_TASK_ID, t.to_string()));
        }
        if let Some(a) = self.attempt {
            env.push((ENV_ATTEMPT, a.to_string()));
        }
        if let Some(a) = self.attempt_id {
            env.push((ENV_ATTEMPT_ID, a.to_string()));
        }
        if let Some(d) = self.delivery {
            env.push((ENV_DELIVERY, d.to_string()));
        }
        if let Some(p) = &self.produces {
            env.push((ENV_PRODUCES, p.join(",")));
        }
        env.push((
            ENV_DATAFLOW,
            match self.dataflow {
                DataflowValidation::Strict => "strict",
                DataflowValidation::Lenient => "lenient",
            }
            .to_owned(),
        ));
        if let Some(t) = &self.trace {
            env.push((ENV_TRACEPARENT, t.traceparent.clone()));
            if let Some(state) = &t.tracestate {
                env.push((ENV_TRACESTATE, state.clone()));
            }
        }
        if let Some(r) = &self.role {
            env.push((ENV_ROLE, r.clone()));
        }
        env
    }

    /// Who writes: `{run, task, attempt}` for an agent, `{run, by}` for an operator.
    pub fn writer(&self) -> Writer {
        Writer {
            run_id: self.run_id,
            task_id: self.task_id.clone(),
            attempt: self.attempt,
            by: self.by.clone(),
        }
    }

    /// The task acting, required by mailbox operations.
    pub fn address(&self) -> Result<&str, ContextError> {
        self.task_id.as_ref().map(TaskId::as_str).ok_or_else(|| {
            invalid_scope(
                "this needs a task identity: run inside a task, or act as one (--as TASK)".into(),
            )
        })
    }

    /// Whether this scope is one execution of a task attempt (an agent, not an operator).
    pub fn is_attempt(&self) -> bool {
        self.attempt_id.is_some() && self.task_id.is_some()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn envelope() -> TaskEnvelope {
        serde_json::from_value(serde_json::json!({
            "run_id": RunId::new(),
            "task_id": "calc_growth",
            "attempt": 2,
            "attempt_id": AttemptId::new(),
            "pool": "default",
            "required": true,
            "timeout": 60,
            "produces": ["Growth Rate"],
            "dataflow_validation": "lenient",
            "dispatched_at": "2026-01-01T00:00:00Z",
            "trace": {
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "tracestate": "vendor=a"
            }
        }))
        .expect("envelope")
    }

    #[test]
    fn env_round_trips() {
        let task = envelope();
        let scope = Scope::from_envelope(&task, 3, Names::new("acme").expect("prefix"));
        assert_eq!(scope.produces, Some(vec!["growth_rate".to_string()]));
        assert_eq!(scope.session, task.run_id.to_string());
        let vars: HashMap<&str, String> = scope.to_env().into_iter().collect();
        assert_eq!(
            vars[ENV_TRACEPARENT],
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
        let back = Scope::from_vars(|k| vars.get(k).cloned()).expect("from env");
        assert_eq!(back, scope);
    }

    #[test]
    fn empty_produces_is_declared_nothing_and_unset_is_unrestricted() {
        let run = RunId::new().to_string();
        let with = |produces: Option<&str>| {
            let run = run.clone();
            let produces = produces.map(str::to_owned);
            Scope::from_vars(move |k| match k {
                ENV_RUN_ID => Some(run.clone()),
                ENV_PRODUCES => produces.clone(),
                _ => None,
            })
            .expect("scope")
        };
        assert_eq!(with(Some("")).produces, Some(vec![]));
        assert_eq!(with(None).produces, None);
        assert_eq!(
            with(Some("a, B c")).produces,
            Some(vec!["a".into(), "b_c".into()])
        );
    }

    #[test]
    fn a_malformed_traceparent_is_dropped() {
        let run = RunId::new().to_string();
        let with = |tp: &'static str| {
            let run = run.clone();
            Scope::from_vars(move |k| match k {
                ENV_RUN_ID => Some(run.clone()),
                ENV_TRACEPARENT => Some(tp.to_owned()),
                _ => None,
            })
            .expect("scope")
        };
        assert_eq!(with("garbage").trace, None);
        assert_eq!(with("").trace, None);
        let ok = with("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(ok.trace.map(|t| t.tracestate), Some(None));
    }

    #[test]
    fn bad_variables_are_invalid_scope() {
        let err = Scope::from_vars(|_| None).expect_err("no run");
        assert_eq!(err.code(), "invalid_scope");
        assert!(err.message().contains(ENV_RUN_ID), "{err}");
        let run = RunId::new().to_string();
        let err = Scope::from_vars(|k| match k {
            ENV_RUN_ID => Some(run.clone()),
            ENV_DATAFLOW => Some("loose".into()),
            _ => None,
        })
        .expect_err("bad mode");
        assert!(err.message().contains("loose"), "{err}");
        let err = Scope::from_vars(|k| match k {
            ENV_RUN_ID => Some(run.clone()),
            ENV_SESSION_ID => Some("a.b".into()),
            _ => None,
        })
        .expect_err("bad session");
        assert_eq!(err.code(), "invalid_scope");
    }
}
