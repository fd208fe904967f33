//! SIGTERM/SIGINT handling shared by the long-running commands (`worker`, `serve`).

/// Resolves on the first SIGTERM or SIGINT, and arms the second one to exit at once.
pub async fn first_signal() {
    wait_for_signal().await;
    tracing::info!("signal received: shutting down (send it again to exit at once)");
    tokio::spawn(async {
        wait_for_signal().await;
        eprintln!("second signal: exiting now");
        std::process::exit(130);
    });
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM ({e}); only Ctrl-C stops this process");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
