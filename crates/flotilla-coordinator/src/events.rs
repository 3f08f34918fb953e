//! Events the coordinator says outside a machine step: a rejection at intake, a run failed at
//! admission, an external agent's question (the machine's own events go out with its step).

use flotilla_bus::Bus;

/// Publishes one event on its run's events (a batch of one, de-duplicated by the event's id):
/// for the events the coordinator says outside a machine step — a rejection at intake, a run
/// failed at admission, an external agent's question.
pub(crate) async fn publish_event(
    bus: &Bus,
    event: flotilla_model::event::EventEnvelope,
) -> Result<(), flotilla_bus::PublishError> {
    let run = event.run_id;
    let batch = flotilla_model::event::EventBatch::new(run, vec![event]);
    bus.publish(bus.names().event(run), &batch, Some(&batch.msg_id()))
        .await?;
    Ok(())
}
