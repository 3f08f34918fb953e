//! Cancelling the attempts of a stopped run: a notice in the control bucket, which workers
//! watch, and the run's queued tasks purged from the task stream.

use super::{Cached, Runtime, StepError};

impl Runtime {
    /// Tells the workers running attempts of a stopped run to cancel them: a notice in the
    /// control bucket (workers watch it, so they react at once), and the run's queued tasks
    /// are removed from the task stream so no worker starts them.
    pub(super) async fn cancel_attempts(&self, entry: &Cached) -> Result<(), StepError> {
        let state = entry.machine.state();
        let run = state.run_id;
        let names = self.bus.names();
        let kv = self
            .bus
            .kv(flotilla_model::subjects::Bucket::Control)
            .await
            .map_err(|e| StepError::Failed(e.to_string()))?;
        let notice = serde_json::json!({
            "run_id": run,
            "action": "cancel",
            "reason": state.stop_reason,
        });
        kv.put(names.cancel_key(run), notice.to_string().into())
            .await
            .map_err(|e| StepError::Failed(format!("writing the cancel notice of {run}: {e}")))?;
        let stream_name = names.stream(flotilla_model::subjects::StreamKind::Tasks);
        let stream = self
            .bus
            .js()
            .get_stream(&stream_name)
            .await
            .map_err(|e| StepError::Failed(format!("opening {stream_name}: {e}")))?;
        stream
            .purge()
            .filter(format!("{}.task.*.{run}.*", names.prefix()))
            .await
            .map_err(|e| StepError::Failed(format!("removing the queued tasks of {run}: {e}")))?;
        Ok(())
    }
}
