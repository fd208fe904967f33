//! The worker's Prometheus metrics: live counters kept beside the registry's own (two-phase
//! commit outcomes, forward-pass latency) and the text exposition of everything
//! `tetherctl status` shows, so a leak or a stuck session is a line on a dashboard.

use crate::registry::SessionRegistry;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tether_metrics::{LabelText, register, render};
use tether_protocol::EndReason;

/// Upper bounds (seconds) of the forward-pass latency buckets: from a decode step of a tiny
/// model on a GPU to a long prefill micro-batch on a CPU.
pub const FORWARD_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// A step of the two-phase-commit protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// A Prepare (plan, admit, build, upload, verify).
    Prepare,
    /// A Commit.
    Commit,
    /// An Abort.
    Abort,
}

impl TxnOp {
    const ALL: [TxnOp; 3] = [TxnOp::Prepare, TxnOp::Commit, TxnOp::Abort];

    fn as_str(self) -> &'static str {
        match self {
            Self::Prepare => "prepare",
            Self::Commit => "commit",
            Self::Abort => "abort",
        }
    }
}

/// Where a Prepare's tensor bytes came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorSourceKind {
    /// Chunks in the Prepare stream (from the coordinator's copy).
    Network,
    /// The worker's own copy of the model file (`--model-dir`).
    LocalFile,
}

impl TensorSourceKind {
    const ALL: [TensorSourceKind; 2] = [TensorSourceKind::Network, TensorSourceKind::LocalFile];

    fn as_str(self) -> &'static str {
        match self {
            Self::Network => "network",
            Self::LocalFile => "local_file",
        }
    }
}

/// Labels of one two-phase-commit series: `op` and `result`.
type TxnLabels = [(&'static str, &'static str); 2];
/// Labels of a series told apart by one fixed label.
type OneLabel = [(&'static str, &'static str); 1];
/// Gauges set at each scrape from the registry's status.
type Gauges<L> = Family<L, Gauge<u64, AtomicU64>>;

fn txn_labels(op: TxnOp, ok: bool) -> TxnLabels {
    [
        ("op", op.as_str()),
        ("result", if ok { "ok" } else { "refused" }),
    ]
}

fn source_labels(source: TensorSourceKind) -> OneLabel {
    [("source", source.as_str())]
}

/// Counters the registry keeps for the metrics endpoint only.
#[derive(Debug)]
pub(crate) struct WorkerMetrics {
    txn: Family<TxnLabels, Counter>,
    forward: Histogram,
    /// The forward passes' time in all, for `forward_time` (prometheus-client's histogram
    /// keeps its sum to itself).
    forward_nanos: AtomicU64,
    /// Tensor bytes staged, by [`TensorSourceKind`].
    tensor_bytes: Family<OneLabel, Counter>,
    /// Prepares that named the worker's own copy of the model and were refused.
    local_refused: Counter,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        let metrics = Self {
            txn: Family::default(),
            forward: Histogram::new(FORWARD_BUCKETS),
            forward_nanos: AtomicU64::new(0),
            tensor_bytes: Family::default(),
            local_refused: Counter::default(),
        };
        // Every series exists from the start, at 0, so a dashboard's rate() has a first
        // point before the first event.
        for op in TxnOp::ALL {
            for ok in [true, false] {
                drop(metrics.txn.get_or_create(&txn_labels(op, ok)));
            }
        }
        for source in TensorSourceKind::ALL {
            drop(metrics.tensor_bytes.get_or_create(&source_labels(source)));
        }
        metrics
    }
}

impl WorkerMetrics {
    /// Counts one outcome of a two-phase-commit step.
    pub fn count_txn(&self, op: TxnOp, ok: bool) {
        self.txn.get_or_create(&txn_labels(op, ok)).inc();
    }

    /// How many `op` steps ended ok (`true`) or refused (`false`).
    #[cfg(test)]
    pub fn txn_count(&self, op: TxnOp, ok: bool) -> u64 {
        self.txn.get_or_create(&txn_labels(op, ok)).get()
    }

    /// Records the duration of one forward pass.
    pub fn observe_forward(&self, took: Duration) {
        self.forward.observe(took.as_secs_f64());
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.forward_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// The time every forward pass so far took in all.
    pub fn forward_total(&self) -> Duration {
        Duration::from_nanos(self.forward_nanos.load(Ordering::Relaxed))
    }

    /// Counts tensor bytes copied into a staged block from `source`.
    pub fn count_tensor_bytes(&self, source: TensorSourceKind, bytes: u64) {
        self.tensor_bytes
            .get_or_create(&source_labels(source))
            .inc_by(bytes);
    }

    /// Tensor bytes staged from `source` so far.
    #[cfg(test)]
    pub fn tensor_bytes(&self, source: TensorSourceKind) -> u64 {
        self.tensor_bytes
            .get_or_create(&source_labels(source))
            .get()
    }

    /// Counts one refused read of the worker's own copy of the model.
    pub fn count_local_refused(&self) {
        self.local_refused.inc();
    }

    /// Refused reads of the worker's own copy of the model so far.
    #[cfg(test)]
    pub fn local_refused(&self) -> u64 {
        self.local_refused.get()
    }
}

/// A family of gauges holding `values`, for series read from the status at each scrape.
fn gauges<L>(values: impl IntoIterator<Item = (L, u64)>) -> Gauges<L>
where
    L: Clone + std::hash::Hash + Eq,
{
    let family = Gauges::default();
    for (labels, value) in values {
        family.get_or_create(&labels).set(value);
    }
    family
}

impl SessionRegistry {
    /// Everything the worker reports, in the Prometheus text exposition format: the live
    /// counters, and the status read now.
    pub fn prometheus_text(&self) -> String {
        let status = self.status();
        let sessions = self.sessions();
        let mut reg = Registry::default();

        let used = status
            .device_total_bytes
            .saturating_sub(status.device_free_bytes);
        register(
            &mut reg,
            "tether_device_bytes",
            "Device memory: total and free as the driver reports them, used = total - free, baseline = used when the worker started.",
            gauges([
                ([("kind", "total")], status.device_total_bytes),
                ([("kind", "free")], status.device_free_bytes),
                ([("kind", "used")], used),
                ([("kind", "baseline")], status.baseline_used_bytes),
            ]),
        );
        register(
            &mut reg,
            "tether_max_memory_bytes",
            "The admission limit all sessions share (--max-memory).",
            ConstGauge::new(status.max_memory_bytes),
        );
        register(
            &mut reg,
            "tether_session_bytes",
            "Bytes held by one live session (committed and staged).",
            gauges(sessions.iter().map(|s| {
                (
                    [
                        ("session", LabelText(s.session_id.clone())),
                        ("client", LabelText(s.client_name.clone())),
                    ],
                    s.bytes,
                )
            })),
        );
        register(
            &mut reg,
            "tether_session_kv_blocks",
            "Blocks of one session's paged KV pool: all of them (state total), and those no sequence holds (state free).",
            gauges(sessions.iter().flat_map(|s| {
                [("total", s.kv_blocks), ("free", s.kv_blocks_free)].map(|(state, n)| {
                    (
                        [
                            ("session", LabelText(s.session_id.clone())),
                            ("state", LabelText(state.to_string())),
                        ],
                        n,
                    )
                })
            })),
        );
        register(
            &mut reg,
            "tether_sessions",
            "Live sessions.",
            ConstGauge::new(u64::from(status.sessions)),
        );

        let c = status.counters;
        register(
            &mut reg,
            "tether_sessions_opened_total",
            "Sessions opened since the worker started.",
            ConstCounter::new(c.opened),
        );
        let ended = Family::<OneLabel, Counter>::default();
        for (reason, value) in [
            (EndReason::Closed, c.closed),
            (EndReason::Disconnected, c.disconnected),
            (EndReason::Reaped, c.reaped),
            (EndReason::Killed, c.killed),
            (EndReason::Shutdown, c.shutdown),
        ] {
            ended
                .get_or_create(&[("reason", reason.as_str())])
                .inc_by(value);
        }
        register(
            &mut reg,
            "tether_sessions_ended_total",
            "Sessions ended since the worker started, by reason.",
            ended,
        );
        register(
            &mut reg,
            "tether_reaped_total",
            "Sessions ended by the reaper: no heartbeat within their lease TTL.",
            ConstCounter::new(c.reaped),
        );
        register(
            &mut reg,
            "tether_txn_total",
            "Two-phase-commit steps by operation and result.",
            self.metrics.txn.clone(),
        );
        register(
            &mut reg,
            "tether_txn_timed_out_total",
            "Prepared transactions aborted because no decision came within their timeout.",
            ConstCounter::new(c.txn_timed_out),
        );
        register(
            &mut reg,
            "tether_tensor_bytes_total",
            "Tensor bytes staged by Prepare, by where they came from: chunks over the network, or the worker's own copy of the model file (--model-dir).",
            self.metrics.tensor_bytes.clone(),
        );
        register(
            &mut reg,
            "tether_local_model_refused_total",
            "Prepares that asked the worker to read its own copy of the model and were refused (no --model-dir, outside it, missing, or a different file); the coordinator then streams.",
            self.metrics.local_refused.clone(),
        );
        register(
            &mut reg,
            "tether_forward_seconds",
            "Duration of successful forward passes.",
            self.metrics.forward.clone(),
        );
        register(
            &mut reg,
            "tether_unaccounted_bytes",
            "Memory the worker holds beyond its idle baseline and its sessions' bytes (a leak shows here).",
            ConstGauge::new(status.unaccounted_bytes),
        );
        register(
            &mut reg,
            "tether_unaccounted_source",
            "What tether_unaccounted_bytes counts (1 for the source in use): driver_per_process (NVML), device_used (cuMemGetInfo) or process_rss (cpu).",
            gauges([([("source", status.memory_source.as_str())], 1)]),
        );
        // Absent when the driver cannot tell: a 0 would read as "holds nothing".
        let per_process = (status.process_device_bytes > 0).then_some([
            ([("when", "now")], status.process_device_bytes),
            ([("when", "start")], status.baseline_process_device_bytes),
        ]);
        register(
            &mut reg,
            "tether_process_device_bytes",
            "Device memory of the worker process as the driver counts it per process (NVML), now and at start; absent when it cannot tell.",
            gauges(per_process.into_iter().flatten()),
        );
        register(
            &mut reg,
            "tether_process_resident_bytes",
            "Resident memory of the worker process, now and at start (Linux).",
            gauges([
                ([("when", "now")], status.process_rss_bytes),
                ([("when", "baseline")], status.baseline_rss_bytes),
            ]),
        );
        register(
            &mut reg,
            "tether_draining",
            "1 while the worker refuses new sessions (draining or shutting down).",
            ConstGauge::new(u64::from(status.draining)),
        );
        render(&reg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_bytes_are_kept_apart_by_source() {
        let m = WorkerMetrics::default();
        m.count_tensor_bytes(TensorSourceKind::Network, 10);
        m.count_tensor_bytes(TensorSourceKind::LocalFile, 7);
        m.count_tensor_bytes(TensorSourceKind::LocalFile, 5);
        m.count_local_refused();
        assert_eq!(
            (
                m.tensor_bytes(TensorSourceKind::Network),
                m.tensor_bytes(TensorSourceKind::LocalFile),
                m.local_refused()
            ),
            (10, 12, 1)
        );
    }

    #[tokio::test]
    async fn a_client_name_stays_inside_its_label() {
        use crate::registry::RegistryConfig;
        use crate::testing::FakeFactory;
        use std::sync::Arc;
        let registry = SessionRegistry::new(
            Arc::new(FakeFactory { free: 1 << 20 }),
            1 << 20,
            RegistryConfig::default(),
        );
        let lease = tether_protocol::Lease {
            heartbeat_interval: Duration::from_millis(100),
            ttl: Duration::from_secs(5),
        };
        let _ticket = registry.open("a\"b\\c\nd", lease).expect("open");
        let text = registry.prometheus_text();
        assert!(text.contains(",client=\"a\\\"b\\\\c\\nd\"} "), "{text}");
        assert!(text.contains("\ntether_sessions 1\n"), "{text}");
    }

    #[test]
    fn txn_counts_keep_ok_and_refused_apart() {
        let m = WorkerMetrics::default();
        m.count_txn(TxnOp::Commit, true);
        m.count_txn(TxnOp::Commit, false);
        m.count_txn(TxnOp::Commit, false);
        assert_eq!(
            (
                m.txn_count(TxnOp::Commit, true),
                m.txn_count(TxnOp::Commit, false),
                m.txn_count(TxnOp::Prepare, true),
            ),
            (1, 2, 0)
        );
    }
}
