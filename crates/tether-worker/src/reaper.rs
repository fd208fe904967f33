//! The reaper: a task that ends sessions whose heartbeats stopped for their TTL (zombies
//! whose TCP connection may still be open) and aborts prepared transactions that saw no
//! decision in time. It reads tokio's clock, so tests drive it with `tokio::time::pause`.

use crate::registry::SessionRegistry;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// Checks `registry` every `period` until `stop` is cancelled.
pub async fn run_reaper(registry: Arc<SessionRegistry>, period: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {
                registry.reap_expired(Instant::now());
            }
        }
    }
}
