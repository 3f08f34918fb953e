//! Publishing notices (`<prefix>.notify.<kind>.<run>`, kept on the notice stream).
//!
//! A notice follows its record (the approval in the escalations bucket, the control on the
//! run log) and never decides anything, so a notice that cannot be published is logged and
//! the operation goes on: `approval.list` and the run's events still show what waits. Its id
//! is its `Nats-Msg-Id`, so publishing the same notice again stores it once.

use flotilla_bus::Bus;
use flotilla_model::notify::Notification;
use tracing::warn;

/// Publishes `notice` on its subject and waits for the notice stream to store it.
pub(crate) async fn publish(bus: &Bus, notice: &Notification) {
    let Some(run) = notice.run_id else {
        warn!(id = %notice.id, "A notice without a run was not published");
        return;
    };
    let subject = bus.names().notify(notice.kind.as_str(), run);
    let id = (!notice.id.is_empty()).then_some(notice.id.as_str());
    if let Err(e) = bus.publish(subject, notice, id).await {
        warn!(%run, id = %notice.id, kind = notice.kind.as_str(), error = %e, "Could not publish a notice");
    }
}
