//! Warns when memory that no session accounts for stays high: a leak in the worker, the
//! driver or a library shows up as `unaccounted_bytes` that does not come back down.
//!
//! A single high sample is normal (a session ending frees its memory a moment after its
//! bytes leave the ledger; allocators keep freed pages for a while), so the warning needs
//! the figure above the threshold for a whole window, and then repeats only while it stays
//! there, once per `repeat`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::registry::SessionRegistry;

/// Defaults: 256 MiB for 30 s, repeated every 5 minutes; sampled every 5 s.
pub const DEFAULT_THRESHOLD: u64 = 256 << 20;
pub const DEFAULT_WINDOW: Duration = Duration::from_secs(30);
const REPEAT: Duration = Duration::from_secs(300);
const SAMPLE_EVERY: Duration = Duration::from_secs(5);

/// The decision, fed one sample at a time.
#[derive(Debug)]
pub struct LeakWatch {
    threshold: u64,
    window: Duration,
    repeat: Duration,
    above_since: Option<Instant>,
    warned_at: Option<Instant>,
}

/// A warning to log: how much is unaccounted and for how long it has been above.
#[derive(Debug, PartialEq, Eq)]
pub struct LeakWarning {
    pub unaccounted_bytes: u64,
    pub above_for: Duration,
}

impl LeakWatch {
    pub fn new(threshold: u64, window: Duration, repeat: Duration) -> Self {
        Self {
            threshold,
            window,
            repeat,
            above_since: None,
            warned_at: None,
        }
    }

    /// Takes the sample `bytes` seen at `now`; returns a warning when one is due.
    pub fn observe(&mut self, now: Instant, bytes: u64) -> Option<LeakWarning> {
        if bytes <= self.threshold {
            self.above_since = None;
            self.warned_at = None;
            return None;
        }
        let since = *self.above_since.get_or_insert(now);
        let above_for = now.saturating_duration_since(since);
        if above_for < self.window {
            return None;
        }
        let due = self
            .warned_at
            .is_none_or(|at| now.saturating_duration_since(at) >= self.repeat);
        if !due {
            return None;
        }
        self.warned_at = Some(now);
        Some(LeakWarning {
            unaccounted_bytes: bytes,
            above_for,
        })
    }
}

/// Samples the registry's status until the task is dropped, logging each warning.
pub async fn watch(registry: Arc<SessionRegistry>, threshold: u64, window: Duration) {
    let mut watch = LeakWatch::new(threshold, window, REPEAT);
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    loop {
        tick.tick().await;
        let status = registry.status();
        if let Some(w) = watch.observe(Instant::now(), status.unaccounted_bytes) {
            tracing::warn!(
                unaccounted_bytes = w.unaccounted_bytes,
                above_for_s = w.above_for.as_secs(),
                threshold_bytes = threshold,
                sessions = status.sessions,
                session_bytes = status.session_bytes,
                "memory no session accounts for has stayed above the threshold: a leak in the worker, the driver or a library, or another process on this device (see `tetherctl status`)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn warns_after_the_window_then_once_per_repeat_and_resets_below() {
        let mut w = LeakWatch::new(256 * MIB, Duration::from_secs(30), Duration::from_secs(300));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(w.observe(at(0), 300 * MIB), None);
        assert_eq!(w.observe(at(29), 300 * MIB), None, "inside the window");
        let first = w.observe(at(30), 310 * MIB).expect("due at 30 s");
        assert_eq!(first.unaccounted_bytes, 310 * MIB);
        assert_eq!(first.above_for, Duration::from_secs(30));
        assert_eq!(
            w.observe(at(100), 300 * MIB),
            None,
            "not again before the repeat"
        );
        assert!(w.observe(at(330), 300 * MIB).is_some(), "again after 300 s");
        // Dropping below resets: a new excursion needs a full window again.
        assert_eq!(w.observe(at(331), 10 * MIB), None);
        assert_eq!(w.observe(at(340), 300 * MIB), None);
        assert_eq!(w.observe(at(369), 300 * MIB), None);
        assert!(w.observe(at(370), 300 * MIB).is_some());
    }

    #[test]
    fn a_spike_shorter_than_the_window_never_warns() {
        let mut w = LeakWatch::new(256 * MIB, Duration::from_secs(30), Duration::from_secs(300));
        let t0 = Instant::now();
        for s in (0..600).step_by(5) {
            // 20 s above, 10 s below, forever: never 30 s in a row.
            let bytes = if s % 30 < 20 { 1024 * MIB } else { 0 };
            assert_eq!(
                w.observe(t0 + Duration::from_secs(s), bytes),
                None,
                "at {s} s"
            );
        }
    }

    #[test]
    fn the_threshold_itself_is_not_above() {
        let mut w = LeakWatch::new(256 * MIB, Duration::ZERO, Duration::from_secs(300));
        assert_eq!(w.observe(Instant::now(), 256 * MIB), None);
        assert!(w.observe(Instant::now(), 256 * MIB + 1).is_some());
    }
}
