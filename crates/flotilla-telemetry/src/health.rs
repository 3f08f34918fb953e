//! Liveness and readiness.
//!
//! *Alive* (`/healthz`) means the process runs and its HTTP listener answers; nothing else, so
//! a restart is never triggered by a slow NATS server. *Ready* (`/readyz`) means every named
//! condition holds and the process is not draining:
//!
//! ```text
//!  register conditions (all false) ─► flip as start-up progresses ─► all true: ready
//!                                                                    │ SIGTERM
//!                                                                    ▼
//!                                                    draining: not ready until the process exits
//! ```
//!
//! Components own their conditions: a service registers `nats_connected`, `provisioned` and
//! `consumer_bound` before its listener starts (so `/readyz` never reports ready too early) and
//! flips each when that step is done. A condition may instead follow a live probe (the NATS
//! connection state), read when `/readyz` is asked.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use serde::Serialize;

type Probe = Box<dyn Fn() -> bool + Send + Sync>;

#[derive(Default)]
struct ConditionState {
    flag: AtomicBool,
    probe: OnceLock<Probe>,
}

impl ConditionState {
    fn holds(&self) -> bool {
        match self.probe.get() {
            Some(probe) => probe(),
            None => self.flag.load(Ordering::Acquire),
        }
    }
}

#[derive(Default)]
struct Inner {
    conditions: Mutex<BTreeMap<String, Arc<ConditionState>>>,
    draining: AtomicBool,
}

/// A process's readiness conditions and draining flag: a cheap, cloneable handle shared by the
/// components of a process and its HTTP listener.
#[derive(Clone, Default)]
pub struct Health {
    inner: Arc<Inner>,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("readiness", &self.readiness())
            .finish()
    }
}

/// One named readiness condition; false until set.
#[derive(Clone)]
pub struct Condition {
    name: String,
    state: Arc<ConditionState>,
}

impl fmt::Debug for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Condition")
            .field("name", &self.name)
            .field("holds", &self.state.holds())
            .finish()
    }
}

impl Condition {
    /// The condition's name, as listed by `/readyz`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Sets the condition (ignored once it follows a probe).
    pub fn set(&self, holds: bool) {
        self.state.flag.store(holds, Ordering::Release);
    }

    /// Whether the condition holds now.
    pub fn holds(&self) -> bool {
        self.state.holds()
    }

    /// From now on the condition is whatever `probe` says when readiness is asked. The probe
    /// must be cheap and must not block (it runs on each `/readyz` request). A condition
    /// follows at most one probe; a second call is ignored and returns `false`.
    pub fn follow(&self, probe: impl Fn() -> bool + Send + Sync + 'static) -> bool {
        self.state.probe.set(Box::new(probe)).is_ok()
    }
}

/// A snapshot of readiness, as served by `/readyz` (JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Readiness {
    /// Every condition holds and the process is not draining.
    pub ready: bool,
    /// The process is shutting down (it finishes or hands back its work, takes no new work).
    pub draining: bool,
    /// Each condition by name.
    pub conditions: BTreeMap<String, bool>,
}

impl Health {
    /// No conditions, not draining.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a condition (false until set), or returns the existing one of that name, so a
    /// component that restarts keeps flipping the same condition.
    pub fn condition(&self, name: impl Into<String>) -> Condition {
        let name = name.into();
        let mut conditions = self
            .inner
            .conditions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let state = Arc::clone(conditions.entry(name.clone()).or_default());
        Condition { name, state }
    }

    /// Marks the process as draining: it stays alive but reports not ready until it exits.
    pub fn set_draining(&self) {
        self.inner.draining.store(true, Ordering::Release);
    }

    /// Whether [`set_draining`](Self::set_draining) was called.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(Ordering::Acquire)
    }

    /// Every condition now. With no conditions registered a process that is not draining is
    /// ready: register conditions before serving `/readyz`.
    pub fn readiness(&self) -> Readiness {
        let states: Vec<(String, Arc<ConditionState>)> = self
            .inner
            .conditions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect();
        // Probes run outside the lock: a slow one cannot block registration.
        let conditions: BTreeMap<String, bool> =
            states.into_iter().map(|(k, s)| (k, s.holds())).collect();
        let draining = self.is_draining();
        Readiness {
            ready: !draining && conditions.values().all(|&v| v),
            draining,
            conditions,
        }
    }

    /// Whether the process is ready now.
    pub fn is_ready(&self) -> bool {
        self.readiness().ready
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_every_condition_holds() {
        let health = Health::new();
        let nats = health.condition("nats_connected");
        let bound = health.condition("consumer_bound");
        assert!(!health.is_ready());
        nats.set(true);
        assert!(!health.is_ready());
        bound.set(true);
        let r = health.readiness();
        assert!(r.ready);
        assert_eq!(
            r.conditions,
            BTreeMap::from([
                ("consumer_bound".to_string(), true),
                ("nats_connected".to_string(), true)
            ])
        );
        nats.set(false);
        assert!(!health.is_ready());
    }

    #[test]
    fn draining_is_not_ready_even_with_every_condition() {
        let health = Health::new();
        health.condition("provisioned").set(true);
        assert!(health.is_ready());
        health.set_draining();
        let r = health.readiness();
        assert!(!r.ready);
        assert!(r.draining);
        assert_eq!(r.conditions.get("provisioned"), Some(&true));
    }

    #[test]
    fn same_name_is_the_same_condition() {
        let health = Health::new();
        let a = health.condition("provisioned");
        let b = health.clone().condition("provisioned");
        b.set(true);
        assert!(a.holds());
        assert_eq!(health.readiness().conditions.len(), 1);
    }

    #[test]
    fn a_probe_replaces_the_flag() {
        let health = Health::new();
        let nats = health.condition("nats_connected");
        let live = Arc::new(AtomicBool::new(false));
        let l = Arc::clone(&live);
        assert!(nats.follow(move || l.load(Ordering::Relaxed)));
        assert!(!nats.follow(|| true), "only one probe");
        nats.set(true); // ignored: the probe decides
        assert!(!health.is_ready());
        live.store(true, Ordering::Relaxed);
        assert!(health.is_ready());
    }
}
