//! Stopping on a signal: what the long-running commands (the services, `up`, `console`) share.

use tokio_util::sync::CancellationToken;
use tracing::info;

/// A token cancelled on SIGTERM or Ctrl-C. The handlers are installed before this returns,
/// so a signal that arrives right after start-up still drains instead of killing.
pub(crate) fn shutdown_on_signals() -> anyhow::Result<CancellationToken> {
    let token = CancellationToken::new();
    let t = token.clone();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!("SIGTERM received: shutting down"),
            _ = interrupt.recv() => info!("Interrupted: shutting down"),
        }
        t.cancel();
    });
    Ok(token)
}
