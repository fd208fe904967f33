//! How far each worker's Prepare stream has got, and whether the worker read its own copy
//! of the model instead, for progress bars: the load writes, a front end reads snapshots.

use crate::load_report::LoadReport;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One worker's part of a load.
#[derive(Clone, Debug)]
struct Entry {
    addr: String,
    total: u64,
    sent: Arc<AtomicU64>,
    read_by_worker: bool,
}

/// The bytes sent and to send per worker during the current (or last) load.
#[derive(Debug, Default)]
pub struct LoadProgress {
    entries: Mutex<Vec<Entry>>,
    /// Where the last finished load spent its time.
    report: Mutex<Option<LoadReport>>,
}

/// A worker's progress at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerProgress {
    /// The worker's address.
    pub addr: String,
    /// Tensor bytes handed to its Prepare stream so far.
    pub sent: u64,
    /// Tensor bytes of its block.
    pub total: u64,
    /// The worker read them from its own copy of the model (`--model-path-on-workers`)
    /// instead of receiving them.
    pub read_by_worker: bool,
}

impl LoadProgress {
    /// Starts a load over `workers` (address, tensor bytes); returns each one's counter.
    pub(crate) fn begin(
        &self,
        workers: impl Iterator<Item = (String, u64)>,
    ) -> Vec<Arc<AtomicU64>> {
        let entries: Vec<Entry> = workers
            .map(|(addr, total)| Entry {
                addr,
                total,
                sent: Arc::default(),
                read_by_worker: false,
            })
            .collect();
        let counters = entries.iter().map(|e| Arc::clone(&e.sent)).collect();
        *self.entries.lock().unwrap_or_else(|e| e.into_inner()) = entries;
        counters
    }

    /// Records that worker `addr` read its block from its own copy of the model.
    pub(crate) fn mark_read_by_worker(&self, addr: &str) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        for e in entries.iter_mut().filter(|e| e.addr == addr) {
            e.read_by_worker = true;
            e.sent.store(e.total, Ordering::Relaxed);
        }
    }

    /// Records where a finished load spent its time.
    pub(crate) fn set_report(&self, report: LoadReport) {
        *self.report.lock().unwrap_or_else(|e| e.into_inner()) = Some(report);
    }

    /// Where the last finished load spent its time; `None` before one has finished.
    pub fn report(&self) -> Option<LoadReport> {
        self.report
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every worker's progress now.
    pub fn snapshot(&self) -> Vec<WorkerProgress> {
        self.entries
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|e| WorkerProgress {
                addr: e.addr.clone(),
                sent: e.sent.load(Ordering::Relaxed).min(e.total),
                total: e.total,
                read_by_worker: e.read_by_worker,
            })
            .collect()
    }
}
