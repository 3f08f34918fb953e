//! Earned trust at admission: with `[hitl.trust] enabled`, a run's escalation policy takes
//! the mode each agent and role its tasks name has earned (novice: `human_in_command`,
//! proficient: `human_in_the_loop`, expert: `human_on_the_loop`).
//!
//! The levels are the supervisor's (`<prefix>-trust`); a coordinator mirrors the bucket in
//! memory, so admitting a run reads nothing over the network. An agent or role nothing was
//! counted for yet is a novice. Levels are read as of the submission's time (through each
//! record's history), and the policy is carried in the run's state: a level that changes
//! later changes the runs submitted after it, and every coordinator and every replay decides
//! a run alike (but for a change made within a moment of the submission that a coordinator's
//! mirror had not received yet).

use std::collections::BTreeMap;

use flotilla_bus::mirror::KvMirror;
use flotilla_machine::policy::HitlConfig;
use flotilla_model::approval::{HitlMode, HitlPolicy};
use flotilla_model::plan::Plan;
use flotilla_model::team::RecordScope;
use flotilla_model::time::Timestamp;
use flotilla_model::trust::{TrustLevel, TrustRecord, trust_key};

/// The trust levels a coordinator admits runs with (none when trust is not enabled).
#[derive(Clone, Default)]
pub(crate) struct Trust {
    levels: Option<KvMirror<TrustRecord>>,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust")
            .field("enabled", &self.levels.is_some())
            .finish()
    }
}

impl Trust {
    /// Admissions use the levels in `mirror` (kept in sync by its follower).
    pub(crate) fn from_mirror(mirror: KvMirror<TrustRecord>) -> Self {
        Self {
            levels: Some(mirror),
        }
    }

    fn level(
        mirror: &KvMirror<TrustRecord>,
        scope: RecordScope,
        name: &str,
        at: Timestamp,
    ) -> TrustLevel {
        mirror
            .get(&trust_key(scope, name))
            .map(|m| m.value.level_at(at))
            .unwrap_or_default()
    }

    /// The earned mode, as of `at` (the submission's time), of every agent and role `plan`
    /// names (keys `agent:<name>`, `role:<name>`); empty when trust is not enabled.
    pub(crate) fn modes(
        &self,
        plan: &Plan,
        default_agent: Option<&str>,
        at: Timestamp,
    ) -> BTreeMap<String, HitlMode> {
        let Some(mirror) = &self.levels else {
            return BTreeMap::new();
        };
        flotilla_machine::policy::trust::trusted_modes(plan, default_agent, |scope, name| {
            Self::level(mirror, scope, name, at)
        })
    }

    /// The policy a run of `plan` submitted at `at` is admitted with. The levels are read
    /// as of `at`, so computing the admission again later (a start performed but not yet
    /// recorded, rebuilt by another coordinator) gives the same policy.
    pub(crate) fn policy(
        &self,
        hitl: &HitlConfig,
        plan: &Plan,
        default_agent: Option<&str>,
        at: Timestamp,
    ) -> Option<HitlPolicy> {
        let trusted = self.modes(plan, default_agent, at);
        flotilla_machine::policy::hitl::resolve_trusted(
            hitl,
            plan.config.hitl.as_ref(),
            default_agent,
            &trusted,
        )
    }
}
