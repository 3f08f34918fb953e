//! The rules of controls: who may lift a hold.

use flotilla_model::lead::LEAD_NAME;

use crate::TaskState;

/// Whether `by` may resume task `t`, which is paused: a person may lift any pause; the run's
/// lead only its own — it does not lift a person's pause (only a person, or the pause's
/// deadline, does). The coordinator's API refuses such a resume before it reaches the run
/// log (`409 paused_by_person`) and the machine changes nothing on one, both by this rule.
pub fn may_resume_task(t: &TaskState, by: Option<&str>) -> bool {
    t.paused_by_lead || by != Some(LEAD_NAME)
}
