//! The worker's live counters and its resident memory, behind the status it reports
//! ([`tether_protocol::WorkerStatus`]).

use std::sync::atomic::{AtomicU64, Ordering};
use tether_protocol::CounterValues;

/// The live counters behind [`CounterValues`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub opened: AtomicU64,
    pub closed: AtomicU64,
    pub disconnected: AtomicU64,
    pub reaped: AtomicU64,
    pub killed: AtomicU64,
    pub shutdown: AtomicU64,
    pub txn_timed_out: AtomicU64,
}

impl Counters {
    pub fn snapshot(&self) -> CounterValues {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterValues {
            opened: get(&self.opened),
            closed: get(&self.closed),
            disconnected: get(&self.disconnected),
            reaped: get(&self.reaped),
            killed: get(&self.killed),
            shutdown: get(&self.shutdown),
            txn_timed_out: get(&self.txn_timed_out),
        }
    }
}

/// Resident memory of this process in bytes, from /proc/self/status (0 where unavailable).
pub fn process_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find_map(|l| {
                let kb = l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim();
                kb.parse::<u64>().ok()
            })
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn rss_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            assert!(super::process_rss_bytes() > 0);
        }
    }
}
