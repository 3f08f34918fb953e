//! Earned trust's rules: the level an agent or role earns from its counted outcomes
//! (`[hitl.trust]`: tasks counted, success rate, days known, days since the last incident)
//! and that level's effect on the mode a run is admitted with.
//!
//! The supervisor keeps the records (`<prefix>-trust`) and calls [`evaluate`] whenever it
//! counts an outcome; a coordinator with `[hitl.trust] enabled` admits a run with
//! [`trusted_modes`] of the agents and roles its tasks name, read as of the submission's
//! time, so every coordinator and every replay admits a run alike.

use std::collections::BTreeMap;

use flotilla_model::approval::HitlMode;
use flotilla_model::plan::Plan;
use flotilla_model::team::{FailureRecord, RecordScope};
use flotilla_model::time::Timestamp;
use flotilla_model::trust::{TrustLevel, TrustRecord};

use super::config::{LevelRule, TrustConfig};

/// The level `record` (counted outcomes) earns for `trust` at `now` under `cfg`, before any
/// pin.
pub fn earned(
    cfg: &TrustConfig,
    record: &FailureRecord,
    trust: &TrustRecord,
    now: Timestamp,
) -> TrustLevel {
    let tasks = record.total_succeeded + record.total_failed;
    let days = |since: Timestamp| (now.unix_ms() - since.unix_ms()).max(0) / 86_400_000;
    let known = days(trust.first_seen);
    let clean = days(
        trust
            .last_incident
            .as_ref()
            .map_or(trust.first_seen, |i| i.at),
    );
    let meets = |r: &LevelRule| {
        tasks >= r.min_tasks
            && tasks > 0
            && u128::from(record.total_succeeded) * 100
                >= u128::from(r.min_success_percent) * u128::from(tasks)
            && known >= i64::from(r.min_days)
            && clean >= i64::from(r.incident_free_days)
    };
    if meets(&cfg.expert) {
        TrustLevel::Expert
    } else if meets(&cfg.proficient) {
        TrustLevel::Proficient
    } else {
        TrustLevel::Novice
    }
}

/// Re-evaluates `trust`'s earned level from `record`; true when it changed (the change is
/// on the record's history). A record that counted fewer outcomes than the last
/// evaluation's (an older copy) changes nothing.
pub fn evaluate(
    trust: &mut TrustRecord,
    cfg: &TrustConfig,
    record: &FailureRecord,
    now: Timestamp,
) -> bool {
    let tasks = record.total_succeeded + record.total_failed;
    if tasks < trust.counted {
        return false;
    }
    let level = earned(cfg, record, trust, now);
    if level == trust.earned {
        return false;
    }
    trust.record_earned(
        level,
        tasks,
        format!(
            "earned: {} ({tasks} tasks, {} succeeded)",
            level.as_str(),
            record.total_succeeded
        ),
        now,
    );
    true
}

/// The mode a level earns: novice `human_in_command` (every dispatch approved), proficient
/// `human_in_the_loop` (escalation triggers wait), expert `human_on_the_loop` (escalations
/// only notify).
pub fn mode_of_level(level: TrustLevel) -> HitlMode {
    match level {
        TrustLevel::Novice => HitlMode::HumanInCommand,
        TrustLevel::Proficient => HitlMode::HumanInTheLoop,
        TrustLevel::Expert => HitlMode::HumanOnTheLoop,
    }
}

/// The earned mode of every agent and role `plan` names (keys `agent:<name>`,
/// `role:<name>`), each agent's or role's level read by `level_of` (the caller reads it as of
/// the submission's time). A task naming no agent and no role is run by `default_agent`.
pub fn trusted_modes(
    plan: &Plan,
    default_agent: Option<&str>,
    mut level_of: impl FnMut(RecordScope, &str) -> TrustLevel,
) -> BTreeMap<String, HitlMode> {
    let mut out = BTreeMap::new();
    for sub in &plan.subtasks {
        let agent = sub
            .agent
            .as_deref()
            .or(default_agent.filter(|_| sub.role.is_none()));
        if let Some(a) = agent {
            out.entry(format!("agent:{a}"))
                .or_insert_with(|| mode_of_level(level_of(RecordScope::Agent, a)));
        }
        if let Some(r) = sub.role.as_deref() {
            out.entry(format!("role:{r}"))
                .or_insert_with(|| mode_of_level(level_of(RecordScope::Role, r)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use flotilla_model::plan::Subtask;

    use super::*;

    fn counted(succeeded: u64, failed: u64) -> FailureRecord {
        let mut r = FailureRecord::new(RecordScope::Agent, "bot");
        r.total_succeeded = succeeded;
        r.total_failed = failed;
        r
    }

    const DAY: i64 = 86_400_000;

    #[test]
    fn levels_rise_by_the_rules_and_an_incident_drops_them_at_once() {
        let cfg = TrustConfig::default();
        let t0 = Timestamp::from_unix_ms(1_700_000_000_000);
        let mut t = TrustRecord::new(RecordScope::Agent, "bot", t0);
        // 50 tasks at 90 % but only 6 days known: novice.
        assert!(!evaluate(
            &mut t,
            &cfg,
            &counted(45, 5),
            Timestamp::from_unix_ms(t0.unix_ms() + 6 * DAY)
        ));
        assert_eq!(t.level(), TrustLevel::Novice);
        // Day 7: proficient.
        let day7 = Timestamp::from_unix_ms(t0.unix_ms() + 7 * DAY);
        assert!(evaluate(&mut t, &cfg, &counted(45, 5), day7));
        assert_eq!(t.level(), TrustLevel::Proficient);
        // 89 %: back to novice.
        assert!(evaluate(&mut t, &cfg, &counted(89, 11), day7));
        assert_eq!(t.level(), TrustLevel::Novice);
        // 200 tasks at 98 % on day 30: expert.
        let day30 = Timestamp::from_unix_ms(t0.unix_ms() + 30 * DAY);
        assert!(evaluate(&mut t, &cfg, &counted(196, 4), day30));
        assert_eq!(t.level(), TrustLevel::Expert);
        // An incident: novice at once, and 7 clean days bring proficient back, 30 expert.
        t.incident("published early", "alice", day30);
        assert_eq!(t.level(), TrustLevel::Novice);
        assert_eq!(t.incidents, 1);
        let later = Timestamp::from_unix_ms(day30.unix_ms() + 7 * DAY);
        assert!(evaluate(&mut t, &cfg, &counted(196, 4), later));
        assert_eq!(t.level(), TrustLevel::Proficient);
        let reasons: Vec<&str> = t.history.iter().map(|c| c.reason.as_str()).collect();
        assert!(
            reasons
                .iter()
                .any(|r| r.starts_with("incident: published early")),
            "{reasons:?}"
        );
        assert!(
            reasons.contains(&"earned: proficient (200 tasks, 196 succeeded)"),
            "{reasons:?}"
        );
        // Read back at earlier times, through the history.
        assert_eq!(
            t.level_at(Timestamp::from_unix_ms(t0.unix_ms() - 1)),
            TrustLevel::Novice
        );
        assert_eq!(
            t.level_at(Timestamp::from_unix_ms(day7.unix_ms() + 1)),
            TrustLevel::Novice
        );
        assert_eq!(
            t.level_at(Timestamp::from_unix_ms(day30.unix_ms() - 1)),
            TrustLevel::Novice
        );
        assert_eq!(
            t.level_at(day30),
            TrustLevel::Novice,
            "the incident at day 30"
        );
        assert_eq!(t.level_at(later), TrustLevel::Proficient);
        // An evaluation from an older copy of the counts changes nothing.
        assert!(!evaluate(&mut t, &cfg, &counted(10, 0), later));
    }

    #[test]
    fn a_pin_wins_until_it_is_lifted() {
        let cfg = TrustConfig::default();
        let now = Timestamp::from_unix_ms(1_700_000_000_000);
        let mut t = TrustRecord::new(RecordScope::Role, "writer", now);
        t.pin(Some(TrustLevel::Expert), "trusted vendor", "bob", now);
        assert_eq!(t.level(), TrustLevel::Expert);
        assert!(
            !evaluate(&mut t, &cfg, &counted(1, 0), now),
            "earned stays novice"
        );
        assert_eq!(t.level(), TrustLevel::Expert);
        t.pin(None, "contract ended", "bob", now);
        assert_eq!(t.level(), TrustLevel::Novice);
        assert_eq!(t.history.len(), 2);
        assert_eq!(mode_of_level(TrustLevel::Novice), HitlMode::HumanInCommand);
        assert_eq!(mode_of_level(TrustLevel::Expert), HitlMode::HumanOnTheLoop);
    }

    #[test]
    fn a_plans_agents_and_roles_take_their_levels_modes() {
        let mut a = Subtask::new("a", "x");
        a.agent = Some("bot".into());
        let mut b = Subtask::new("b", "y");
        b.role = Some("writer".into());
        let c = Subtask::new("c", "z");
        let mut plan = Plan::empty();
        plan.subtasks = vec![a, b, c];
        let modes = trusted_modes(&plan, Some("echo"), |scope, name| match (scope, name) {
            (RecordScope::Agent, "bot") => TrustLevel::Expert,
            (RecordScope::Role, "writer") => TrustLevel::Proficient,
            _ => TrustLevel::Novice,
        });
        assert_eq!(
            modes.into_iter().collect::<Vec<_>>(),
            [
                ("agent:bot".to_owned(), HitlMode::HumanOnTheLoop),
                ("agent:echo".to_owned(), HitlMode::HumanInCommand),
                ("role:writer".to_owned(), HitlMode::HumanInTheLoop),
            ]
        );
    }
}
