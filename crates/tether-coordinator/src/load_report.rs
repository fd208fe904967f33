//! Where a two-phase load spent its time: the coordinator's phases and each worker's own
//! split of its Prepare, for `--timings`, the debug log and the load's throughput line.

use crate::load::BytesVia;
use std::time::Duration;
use tether_client::Prepared;
use tether_protocol::prepare_timings::gb_per_s;

/// One worker's part of a load.
#[derive(Clone, Debug)]
pub struct WorkerLoad {
    /// The worker's address.
    pub addr: String,
    /// How its tensor bytes got there.
    pub via: BytesVia,
    /// Tensor bytes of its block.
    pub tensor_bytes: u64,
    /// Its Prepare as this coordinator saw it, with the worker's own split.
    pub prepared: Prepared,
    /// A first Prepare from the worker's own copy that it refused before the bytes were
    /// streamed (time lost to the fallback), if any.
    pub refused_local: Option<Duration>,
}

impl WorkerLoad {
    /// Tensor bytes per second over the worker's whole Prepare, in GB/s.
    pub fn gb_per_s(&self) -> f64 {
        gb_per_s(self.tensor_bytes, self.prepared.wall)
    }
}

/// The phases of one load over every worker of a plan.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// Opening a session on every worker.
    pub attach: Duration,
    /// Prepare on every worker at once, until the last vote.
    pub prepare: Duration,
    /// Commit on every worker.
    pub commit: Duration,
    /// Opening the data links.
    pub links: Duration,
    /// The whole load.
    pub total: Duration,
    /// Each worker's part, in layer order.
    pub workers: Vec<WorkerLoad>,
}

impl LoadReport {
    /// Tensor bytes over every worker.
    pub fn tensor_bytes(&self) -> u64 {
        self.workers.iter().map(|w| w.tensor_bytes).sum()
    }

    /// Tensor bytes per second over the whole load, in GB/s.
    pub fn gb_per_s(&self) -> f64 {
        gb_per_s(self.tensor_bytes(), self.total)
    }

    /// Logs the load's throughput (info) and its split (debug).
    pub(crate) fn log(&self) {
        tracing::info!(
            tensor_bytes = self.tensor_bytes(),
            seconds = format!("{:.3}", self.total.as_secs_f64()),
            gb_per_s = format!("{:.2}", self.gb_per_s()),
            "loaded {:.2} GB on {} worker(s) in {:.2} s ({:.2} GB/s)",
            self.tensor_bytes() as f64 / 1e9,
            self.workers.len(),
            self.total.as_secs_f64(),
            self.gb_per_s()
        );
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            attach_ms = ms(self.attach),
            prepare_ms = ms(self.prepare),
            commit_ms = ms(self.commit),
            links_ms = ms(self.links),
            "load phases"
        );
        for w in &self.workers {
            let t = &w.prepared.worker;
            tracing::debug!(
                worker = %w.addr,
                via = %w.via,
                coordinator_checksum_ms = ms(w.prepared.digests),
                plan_ms = ms(t.plan),
                allocate_ms = ms(t.allocate),
                read_ms = ms(t.read),
                checksum_ms = ms(t.checksum),
                upload_ms = ms(t.upload),
                finish_ms = ms(t.finish),
                prepare_ms = ms(w.prepared.wall),
                gb_per_s = format!("{:.2}", w.gb_per_s()),
                "worker prepare timings"
            );
        }
    }
}
