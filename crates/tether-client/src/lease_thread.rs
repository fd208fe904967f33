//! The runtime that carries every session's Attach stream and heartbeats: one small runtime
//! on an OS thread of its own, so a caller whose runtime is saturated by request work (or
//! blocked outright) still sends heartbeats on time and its leases never lapse.

use std::sync::OnceLock;
use tokio::runtime::{Builder, Handle};

/// Started on first use and kept for the life of the process: it holds sockets and
/// timers of open sessions only, no device memory, and idles at no cost.
static LEASE_RUNTIME: OnceLock<Result<Handle, String>> = OnceLock::new();

/// The lease runtime's handle, starting its thread on first use.
pub(crate) fn lease_runtime() -> Result<Handle, String> {
    LEASE_RUNTIME.get_or_init(start).clone()
}

fn start() -> Result<Handle, String> {
    let runtime = Builder::new_current_thread()
        .enable_all()
        .thread_name("tether-leases")
        .build()
        .map_err(|e| format!("starting the lease runtime: {e}"))?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("tether-leases".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))
        .map_err(|e| format!("starting the lease thread: {e}"))?;
    Ok(handle)
}
