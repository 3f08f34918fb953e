//! A run log replayed through the machine alone: the state every decision recorded on it
//! leads to, with the actions each entry decided. The coordinator's runtime applies the same
//! entries the same way ([`crate::Input::from_log`]); a replay needs no NATS, no clock and no
//! configuration, because the log holds every input and its server time.

use std::sync::Arc;

use flotilla_model::ids::RunId;
use flotilla_model::runlog::RunInput;

use crate::{Action, Input, RunMachine};

/// One run-log entry as replayed: its stream sequence, its server time (Unix ms) and its
/// input.
pub type LoggedInput<'a> = (u64, i64, &'a RunInput);

/// Replays `log` (in stream order) for run `run`: the machine starts at the log's `submitted`
/// entry and applies every later entry, as the coordinator's runtime does. `None` when the
/// log holds no `submitted` entry (a rejected run, or one whose start was admitted from a
/// durable submission on its own subject: its start is in the run's record, not its log).
/// `each` sees every entry's sequence and the actions it decided.
pub fn replay<'a>(
    run: RunId,
    log: impl IntoIterator<Item = LoggedInput<'a>>,
    mut each: impl FnMut(u64, &[Action]),
) -> Option<RunMachine> {
    let mut machine: Option<RunMachine> = None;
    for (seq, at_ms, input) in log {
        match (&mut machine, input) {
            (None, RunInput::Submitted(s)) => {
                let (mut m, actions) = RunMachine::start(run, s, Arc::new(s.plan.clone()), at_ms);
                m.set_first_seq(seq);
                each(seq, &actions);
                machine = Some(m);
            }
            (Some(m), RunInput::Rejected(r)) => {
                // A rejection after the start (coordinators configured differently): the
                // runtime stops the run with it.
                let reason = rejected_reason(r);
                let actions = m.apply(Input::Abort { reason: &reason }, at_ms);
                each(seq, &actions);
            }
            (None, _) | (Some(_), RunInput::Submitted(_)) => {}
            (Some(m), other) => {
                if let Some(input) = Input::from_log(other, seq) {
                    let actions = m.apply(input, at_ms);
                    each(seq, &actions);
                }
            }
        }
    }
    machine
}

/// Why a started run stops when its log says its submission was rejected after all.
pub fn rejected_reason(r: &flotilla_model::runlog::Rejected) -> String {
    format!(
        "rejected: {}",
        r.errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    )
}
