//! The chaos: every `--chaos-every`, the next service in turn is stopped — with SIGTERM or
//! with SIGKILL (`kill -9`), alternating so that each service gets both over the soak —
//! kept down for `--down-for`, started again, and waited for until its `/readyz` says
//! ready. The turn goes through the kinds before it comes back to one (coordinator, worker,
//! supervisor, console, the second coordinator, …).
//!
//! A service that exits when nobody stopped it is not chaos but a finding: the exit watcher
//! records it (with its exit status) and starts the service again.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::deployment::{Deployment, Kind, Stop, ready, unix_ms};

/// The deployment, shared by the chaos, the exit watcher and the samplers.
pub(crate) type SharedDeployment = Arc<Mutex<Deployment>>;

pub(crate) fn lock(d: &SharedDeployment) -> std::sync::MutexGuard<'_, Deployment> {
    d.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How long a service gets to exit after SIGTERM (a worker's `shutdown-grace` is 25 s)
/// before it is killed.
const TERM_GRACE: Duration = Duration::from_secs(60);
/// How long a started service gets to say it is ready.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// One stop and start of a service.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ChaosEvent {
    pub(crate) service: String,
    pub(crate) kind: Kind,
    pub(crate) how: Stop,
    /// When the signal was sent (unix ms).
    pub(crate) at_ms: i64,
    /// When the process had exited, and how.
    pub(crate) exited_ms: Option<i64>,
    pub(crate) exit: String,
    /// SIGTERM did not end it within the grace: it was killed.
    pub(crate) killed_after_term: bool,
    /// When it was started again, and said it was ready.
    pub(crate) started_ms: Option<i64>,
    pub(crate) ready_ms: Option<i64>,
    /// What went wrong starting it again.
    pub(crate) error: Option<String>,
}

/// A service that exited when nobody stopped it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct UnexpectedExit {
    pub(crate) service: String,
    pub(crate) incarnation: u32,
    pub(crate) at_ms: i64,
    pub(crate) status: String,
}

/// The order services are stopped in: through the kinds before a second of one.
pub(crate) fn order(kinds: &[Kind]) -> Vec<usize> {
    let rank = |k: Kind| match k {
        Kind::Coordinator => 0,
        Kind::Worker => 1,
        Kind::Supervisor => 2,
        Kind::Console => 3,
        Kind::LlmWorker => 4,
    };
    let mut seen: std::collections::HashMap<Kind, usize> = std::collections::HashMap::new();
    let mut keyed: Vec<(usize, usize, usize)> = kinds
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let n = seen.entry(*k).or_default();
            *n += 1;
            (*n, rank(*k), i)
        })
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, _, i)| i).collect()
}

/// How the `k`-th stop (0-based) of a turn of `n` services stops: alternating, so that each
/// service alternates too — with an even `n` shifted by one every turn (else a service would
/// always get the same signal).
pub(crate) fn stop_of(k: usize, n: usize) -> Stop {
    let shift = if n.is_multiple_of(2) { k / n.max(1) } else { 0 };
    if (k + shift).is_multiple_of(2) {
        Stop::Term
    } else {
        Stop::Kill
    }
}

/// Stops and starts services until `stop`, one every `every`.
pub(crate) async fn run(
    dep: SharedDeployment,
    every: Duration,
    down_for: Duration,
    stop: CancellationToken,
    log: Arc<Mutex<Vec<ChaosEvent>>>,
) {
    let turn = {
        let d = lock(&dep);
        order(&d.slots.iter().map(|s| s.kind).collect::<Vec<_>>())
    };
    let mut k = 0usize;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
        let i = turn[k % turn.len()];
        let how = stop_of(k, turn.len());
        k += 1;
        let event = restart(&dep, i, how, down_for).await;
        errln!(
            "soak: {} {} ({}), ready again {}",
            event.service,
            match how {
                Stop::Term => "stopped",
                Stop::Kill => "killed",
            },
            how.as_str(),
            match (event.ready_ms, event.at_ms) {
                (Some(r), at) => format!("{:.1} s after the signal", (r - at) as f64 / 1e3),
                (None, _) => format!(
                    "never: {}",
                    event.error.as_deref().unwrap_or("not ready in time")
                ),
            }
        );
        log.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(event);
    }
}

/// Stops slot `i` with `how`, waits for its exit, keeps it down for `down_for`, starts it
/// again and waits until it is ready.
pub(crate) async fn restart(
    dep: &SharedDeployment,
    i: usize,
    how: Stop,
    down_for: Duration,
) -> ChaosEvent {
    let (service, kind) = {
        let mut d = lock(dep);
        d.slots[i].held = true;
        (d.slots[i].name.clone(), d.slots[i].kind)
    };
    let mut event = ChaosEvent {
        service,
        kind,
        how,
        at_ms: unix_ms(),
        exited_ms: None,
        exit: String::new(),
        killed_after_term: false,
        started_ms: None,
        ready_ms: None,
        error: None,
    };
    if let Err(e) = lock(dep).signal(i, how) {
        event.error = Some(format!("signalling: {e}"));
    }
    let sent = Instant::now();
    loop {
        if let Some(status) = lock(dep).exited(i) {
            event.exited_ms = Some(unix_ms());
            event.exit = status;
            break;
        }
        if !lock(dep).running(i) {
            event.exit = "not running".into();
            break;
        }
        if how == Stop::Term && !event.killed_after_term && sent.elapsed() > TERM_GRACE {
            event.killed_after_term = true;
            let _ = lock(dep).signal(i, Stop::Kill);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(down_for).await;
    let health = {
        let mut d = lock(dep);
        let started = d.start(i);
        d.slots[i].held = false;
        match started {
            Ok(()) => {
                event.started_ms = Some(d.slots[i].started_ms);
                Some(d.slots[i].health)
            }
            Err(e) => {
                event.error = Some(format!("starting: {e}"));
                None
            }
        }
    };
    if let Some(addr) = health {
        let started = Instant::now();
        while started.elapsed() < READY_WITHIN {
            if ready(addr).await {
                let at = unix_ms();
                event.ready_ms = Some(at);
                lock(dep).slots[i].ready_ms.get_or_insert(at);
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    event
}

/// Every second until `stop`: a service that exited on its own is recorded and started
/// again.
pub(crate) async fn watch_exits(
    dep: SharedDeployment,
    exits: Arc<Mutex<Vec<UnexpectedExit>>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        let mut d = lock(&dep);
        for i in 0..d.slots.len() {
            if d.slots[i].held {
                continue;
            }
            let Some(status) = d.exited(i) else {
                continue;
            };
            let exit = UnexpectedExit {
                service: d.slots[i].name.clone(),
                incarnation: d.slots[i].incarnation,
                at_ms: unix_ms(),
                status,
            };
            errln!(
                "soak: {} exited on its own ({}); starting it again",
                exit.service,
                exit.status
            );
            exits
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(exit);
            if let Err(e) = d.start(i) {
                errln!("soak: starting {} again failed: {e}", d.slots[i].name);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_odd_turn_alternates_too() {
        let n = 5;
        for slot in 0..n {
            let signals: Vec<Stop> = (slot..6 * n).step_by(n).map(|k| stop_of(k, n)).collect();
            assert!(
                signals.windows(2).all(|w| w[0] != w[1]),
                "{slot}: {signals:?}"
            );
        }
    }

    #[test]
    fn the_turn_goes_through_the_kinds_and_each_service_gets_both_signals() {
        let kinds = [
            Kind::Coordinator,
            Kind::Coordinator,
            Kind::Worker,
            Kind::Worker,
            Kind::LlmWorker,
            Kind::Supervisor,
            Kind::Supervisor,
            Kind::Console,
        ];
        let turn = order(&kinds);
        assert_eq!(turn, vec![0, 2, 5, 7, 4, 1, 3, 6]);
        let n = turn.len();
        for slot in 0..n {
            let signals: Vec<Stop> = (0..4 * n)
                .filter(|k| turn[k % n] == slot)
                .map(|k| stop_of(k, n))
                .collect();
            assert_eq!(signals.len(), 4);
            assert!(signals.contains(&Stop::Term) && signals.contains(&Stop::Kill));
            // Alternating, turn after turn.
            assert!(
                signals.windows(2).all(|w| w[0] != w[1]),
                "{slot}: {signals:?}"
            );
        }
    }
}
