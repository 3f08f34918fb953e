//! Contract-net over the API: `mbox.role` (the tasks of a run tree playing a role: how a
//! `role:<name>` candidate is expanded) and `mbox.negotiate` (a whole negotiation run for a
//! client or a task, as `from`).
//!
//! | Subject | Request | Reply |
//! |---|---|---|
//! | `<prefix>.api.mbox.role` | `MboxRoleRequest` | `MboxRoleReply` (`404 unknown_role`) |
//! | `<prefix>.api.mbox.negotiate` | `MboxNegotiateRequest` | `MboxNegotiateReply` |
//!
//! **Who plays a role.** A task plays role R when its subtask's `role` is R, or when its agent
//! (the subtask's `agent`, else the deployment's default agent) lists R in its member card's
//! `roles`. Every run of the tree counts (the root's plan, and the plans of its child runs, as
//! far as `run.tree` lists them). The coordinator answers because it holds both the plans and
//! the member cards; workers cannot read the run log. Persistent teammates are not tasks and
//! are not listed.
//!
//! The responder side needs no endpoint of its own: a responder reads its requests with
//! `mbox.read`, offers with `mbox.send` (`type: offer`, the request's `correlation_id`,
//! `payload.confidence` a number) and reads its award with `mbox.read` (a `delegation`, or an
//! `info` with `closed: true` when another won). `docs/protocol.md` spells it out.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use async_nats::service::Request;
use flotilla_context::mailbox::check_address;
use flotilla_context::scope::OPERATOR;
use flotilla_model::ErrorCode;
use flotilla_model::PROTOCOL_VERSION;
use flotilla_model::api::{
    ApiError, MAX_NEGOTIATE_DEADLINE_MS, MboxNegotiateReply, MboxNegotiateRequest, MboxRoleReply,
    MboxRoleRequest,
};
use flotilla_model::ids::{RunId, TaskId};
use flotilla_model::mailbox::addressed_role;
use flotilla_model::plan::Plan;
use flotilla_model::token::check_name;
use flotilla_model::tree::RunTreeNode;

use super::{Api, bad, context_error, parse, store_error};
use crate::error::StoreErrorKind;

/// Most runs of a tree whose plans are read for one role (`run.tree`'s own bound).
const MAX_TREE_RUNS: usize = flotilla_model::tree::MAX_RUNS_PER_ANSWER as usize;

impl Api {
    /// `mbox.role`.
    pub(in crate::api) async fn mbox_role(&self, req: Request) {
        let Some(r) = parse::<MboxRoleRequest>(&req).await else {
            return;
        };
        let answer = self.role(r).await;
        self.answer(&req, "mbox.role", answer).await;
    }

    async fn role(&self, r: MboxRoleRequest) -> Result<MboxRoleReply, ApiError> {
        check_role(&r.role)?;
        let facts = self.run_facts(r.run_id).await?;
        let tasks = self.role_tasks(facts.root, &r.role).await?;
        Ok(MboxRoleReply {
            protocol: PROTOCOL_VERSION,
            role: r.role,
            tasks,
        })
    }

    /// The tasks of the tree under `root` playing `role`, or `404 unknown_role` naming the
    /// roles its tasks do play.
    async fn role_tasks(&self, root: RunId, role: &str) -> Result<Vec<String>, ApiError> {
        let tree = crate::tree::run_tree(&self.store, root, MAX_TREE_RUNS)
            .await
            .map_err(store_error)?
            .ok_or_else(|| {
                ApiError::new(
                    404,
                    ErrorCode::UnknownRun,
                    format!("run {root} does not exist"),
                )
            })?;
        let mut runs = Vec::new();
        collect_runs(&tree.root, &mut runs);
        let catalog = self.ctx.agents.as_ref();
        let mut by_role: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for run in runs {
            let Some(plan) = self.plan_followed(run).await? else {
                continue;
            };
            for t in &plan.subtasks {
                let mut roles: BTreeSet<&str> = t.role.as_deref().into_iter().collect();
                let agent = t
                    .agent
                    .as_deref()
                    .or_else(|| catalog.and_then(|c| c.default.as_deref()));
                if let (Some(agent), Some(catalog)) = (agent, catalog) {
                    for (r, agents) in &catalog.roles {
                        if agents.contains(agent) {
                            roles.insert(r);
                        }
                    }
                }
                for r in roles {
                    by_role
                        .entry(r.to_owned())
                        .or_default()
                        .insert(t.id.as_str().to_owned());
                }
            }
        }
        match by_role.remove(role) {
            Some(tasks) => Ok(tasks.into_iter().collect()),
            None => Err(ApiError::new(
                404,
                ErrorCode::UnknownRole,
                format!(
                    "no task of the run tree of {root} plays role {role:?}; the roles its tasks play: {}",
                    if by_role.is_empty() {
                        "none".to_owned()
                    } else {
                        by_role.keys().cloned().collect::<Vec<_>>().join(", ")
                    }
                ),
            )),
        }
    }

    /// The plan `run` follows: the planner's for a planned bare query, else the submission's.
    async fn plan_followed(&self, run: RunId) -> Result<Option<Plan>, ApiError> {
        let plan_seq = match self.store.load(run).await.map_err(store_error)? {
            Some(s) => s.snapshot.state.plan_seq,
            None => 0,
        };
        match self.store.plan_of(run, plan_seq).await {
            Ok(plan) => Ok(plan),
            // A run rejected before its plan was recorded has none.
            Err(e) if e.kind() == StoreErrorKind::Decode => Ok(None),
            Err(e) => Err(store_error(e)),
        }
    }

    /// `mbox.negotiate`.
    pub(in crate::api) async fn mbox_negotiate(&self, req: Request) {
        let Some(r) = parse::<MboxNegotiateRequest>(&req).await else {
            return;
        };
        let answer = self.negotiate(r).await;
        self.answer(&req, "mbox.negotiate", answer).await;
    }

    async fn negotiate(&self, r: MboxNegotiateRequest) -> Result<MboxNegotiateReply, ApiError> {
        check_address(&r.from).map_err(context_error)?;
        if !(1..=MAX_NEGOTIATE_DEADLINE_MS).contains(&r.deadline_ms) {
            return Err(bad(
                ErrorCode::InvalidDeadline,
                format!(
                    "deadline_ms {} is out of range: give 1 to {MAX_NEGOTIATE_DEADLINE_MS}",
                    r.deadline_ms
                ),
            ));
        }
        if r.candidates.is_empty() {
            return Err(bad(
                ErrorCode::InvalidAddress,
                "a negotiation needs at least one candidate (a task id, or role:<name>)",
            ));
        }
        let facts = self.run_facts(r.run_id).await?;
        // Roles are expanded here (the coordinator holds the plans and cards); the initiator
        // is left out of its own role.
        let mut candidates = Vec::with_capacity(r.candidates.len());
        for c in &r.candidates {
            match addressed_role(c) {
                Some(role) => {
                    check_role(role)?;
                    candidates.extend(
                        self.role_tasks(facts.root, role)
                            .await?
                            .into_iter()
                            .filter(|t| *t != r.from),
                    );
                }
                None => candidates.push(c.clone()),
            }
        }
        let mut scope = facts.scope(self).with_task(TaskId::new(r.from.as_str()));
        // A task negotiates as itself; anyone else is a client outside the plan.
        scope.by = (!facts.has_task(&r.from)).then(|| OPERATOR.to_owned());
        let negotiated = self
            .clients(scope)?
            .mailbox()
            .run_negotiation(
                r.correlation_id.as_deref(),
                &candidates,
                r.request,
                r.work,
                Duration::from_millis(r.deadline_ms),
            )
            .await
            .map_err(context_error)?;
        Ok(negotiated.reply())
    }
}

/// A role name, or `400 invalid_address`.
fn check_role(role: &str) -> Result<(), ApiError> {
    check_name(role).map_err(|e| {
        bad(
            ErrorCode::InvalidAddress,
            format!("the role {role:?} {e}; roles are names of letters, digits, `_` and `-`"),
        )
    })
}

fn collect_runs(node: &RunTreeNode, out: &mut Vec<RunId>) {
    out.push(node.run_id);
    for child in &node.children {
        collect_runs(child, out);
    }
}
