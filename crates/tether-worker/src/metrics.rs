//! The worker's Prometheus metrics: live counters kept beside the registry's own (two-phase
//! commit outcomes, forward-pass latency) and the text exposition of everything
//! `tetherctl status` shows, so a leak or a stuck session is a line on a dashboard.

use crate::registry::SessionRegistry;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
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

    fn index(self) -> usize {
        self as usize
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

/// Counters the registry keeps for the metrics endpoint only.
#[derive(Debug, Default)]
pub(crate) struct WorkerMetrics {
    /// `[op][0 = ok, 1 = refused]`.
    txn: [[AtomicU64; 2]; 3],
    forward: Histogram,
    /// Tensor bytes staged, by [`TensorSourceKind`].
    tensor_bytes: [AtomicU64; 2],
    /// Prepares that named the worker's own copy of the model and were refused.
    local_refused: AtomicU64,
}

impl WorkerMetrics {
    /// Counts one outcome of a two-phase-commit step.
    pub fn count_txn(&self, op: TxnOp, ok: bool) {
        self.txn[op.index()][usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    /// How many `op` steps ended ok (`true`) or refused (`false`).
    pub fn txn_count(&self, op: TxnOp, ok: bool) -> u64 {
        self.txn[op.index()][usize::from(!ok)].load(Ordering::Relaxed)
    }

    /// Records the duration of one forward pass.
    pub fn observe_forward(&self, took: Duration) {
        self.forward.observe(took);
    }

    /// The time every forward pass so far took in all.
    pub fn forward_total(&self) -> Duration {
        Duration::from_nanos(self.forward.sum_nanos.load(Ordering::Relaxed))
    }

    /// Counts tensor bytes copied into a staged block from `source`.
    pub fn count_tensor_bytes(&self, source: TensorSourceKind, bytes: u64) {
        self.tensor_bytes[source as usize].fetch_add(bytes, Ordering::Relaxed);
    }

    /// Tensor bytes staged from `source` so far.
    pub fn tensor_bytes(&self, source: TensorSourceKind) -> u64 {
        self.tensor_bytes[source as usize].load(Ordering::Relaxed)
    }

    /// Counts one refused read of the worker's own copy of the model.
    pub fn count_local_refused(&self) {
        self.local_refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Refused reads of the worker's own copy of the model so far.
    pub fn local_refused(&self) -> u64 {
        self.local_refused.load(Ordering::Relaxed)
    }
}

/// A latency histogram over [`FORWARD_BUCKETS`], lock-free.
#[derive(Debug, Default)]
struct Histogram {
    /// Observations per bucket, not cumulative; the last slot counts those above every bound.
    buckets: [AtomicU64; FORWARD_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let slot = FORWARD_BUCKETS
            .iter()
            .position(|&bound| secs <= bound)
            .unwrap_or(FORWARD_BUCKETS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn write(&self, out: &mut String, name: &str) {
        let mut cumulative = 0u64;
        for (bound, count) in FORWARD_BUCKETS.iter().zip(&self.buckets) {
            cumulative += count.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.buckets[FORWARD_BUCKETS.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}");
        let _ = writeln!(out, "{name}_count {cumulative}");
    }
}

/// Escapes a label value as the exposition format asks (backslash, quote, newline).
fn label(value: &str) -> String {
    let mut s = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

impl SessionRegistry {
    /// Everything the worker reports, in the Prometheus text exposition format (0.0.4).
    pub fn prometheus_text(&self) -> String {
        let status = self.status();
        let sessions = self.sessions();
        let mut out = String::with_capacity(4096);

        header(
            &mut out,
            "tether_device_bytes",
            "gauge",
            "Device memory: total and free as the driver reports them, used = total - free, baseline = used when the worker started.",
        );
        let used = status
            .device_total_bytes
            .saturating_sub(status.device_free_bytes);
        for (kind, value) in [
            ("total", status.device_total_bytes),
            ("free", status.device_free_bytes),
            ("used", used),
            ("baseline", status.baseline_used_bytes),
        ] {
            let _ = writeln!(out, "tether_device_bytes{{kind=\"{kind}\"}} {value}");
        }

        header(
            &mut out,
            "tether_max_memory_bytes",
            "gauge",
            "The admission limit all sessions share (--max-memory).",
        );
        let _ = writeln!(out, "tether_max_memory_bytes {}", status.max_memory_bytes);

        header(
            &mut out,
            "tether_session_bytes",
            "gauge",
            "Bytes held by one live session (committed and staged).",
        );
        for s in &sessions {
            let _ = writeln!(
                out,
                "tether_session_bytes{{session=\"{}\",client=\"{}\"}} {}",
                label(&s.session_id),
                label(&s.client_name),
                s.bytes
            );
        }

        header(&mut out, "tether_sessions", "gauge", "Live sessions.");
        let _ = writeln!(out, "tether_sessions {}", status.sessions);

        let c = status.counters;
        header(
            &mut out,
            "tether_sessions_opened_total",
            "counter",
            "Sessions opened since the worker started.",
        );
        let _ = writeln!(out, "tether_sessions_opened_total {}", c.opened);

        header(
            &mut out,
            "tether_sessions_ended_total",
            "counter",
            "Sessions ended since the worker started, by reason.",
        );
        for (reason, value) in [
            (EndReason::Closed, c.closed),
            (EndReason::Disconnected, c.disconnected),
            (EndReason::Reaped, c.reaped),
            (EndReason::Killed, c.killed),
            (EndReason::Shutdown, c.shutdown),
        ] {
            let _ = writeln!(
                out,
                "tether_sessions_ended_total{{reason=\"{}\"}} {value}",
                reason.as_str()
            );
        }

        header(
            &mut out,
            "tether_reaped_total",
            "counter",
            "Sessions ended by the reaper: no heartbeat within their lease TTL.",
        );
        let _ = writeln!(out, "tether_reaped_total {}", c.reaped);

        header(
            &mut out,
            "tether_txn_total",
            "counter",
            "Two-phase-commit steps by operation and result.",
        );
        for op in TxnOp::ALL {
            for (result, ok) in [("ok", true), ("refused", false)] {
                let _ = writeln!(
                    out,
                    "tether_txn_total{{op=\"{}\",result=\"{result}\"}} {}",
                    op.as_str(),
                    self.metrics.txn_count(op, ok)
                );
            }
        }

        header(
            &mut out,
            "tether_txn_timed_out_total",
            "counter",
            "Prepared transactions aborted because no decision came within their timeout.",
        );
        let _ = writeln!(out, "tether_txn_timed_out_total {}", c.txn_timed_out);

        header(
            &mut out,
            "tether_tensor_bytes_total",
            "counter",
            "Tensor bytes staged by Prepare, by where they came from: chunks over the network, or the worker's own copy of the model file (--model-dir).",
        );
        for source in TensorSourceKind::ALL {
            let _ = writeln!(
                out,
                "tether_tensor_bytes_total{{source=\"{}\"}} {}",
                source.as_str(),
                self.metrics.tensor_bytes(source)
            );
        }

        header(
            &mut out,
            "tether_local_model_refused_total",
            "counter",
            "Prepares that asked the worker to read its own copy of the model and were refused (no --model-dir, outside it, missing, or a different file); the coordinator then streams.",
        );
        let _ = writeln!(
            out,
            "tether_local_model_refused_total {}",
            self.metrics.local_refused()
        );

        header(
            &mut out,
            "tether_forward_seconds",
            "histogram",
            "Duration of successful forward passes.",
        );
        self.metrics
            .forward
            .write(&mut out, "tether_forward_seconds");

        header(
            &mut out,
            "tether_unaccounted_bytes",
            "gauge",
            "Memory the worker holds beyond its idle baseline and its sessions' bytes (a leak shows here).",
        );
        let _ = writeln!(out, "tether_unaccounted_bytes {}", status.unaccounted_bytes);
        header(
            &mut out,
            "tether_unaccounted_source",
            "gauge",
            "What tether_unaccounted_bytes counts (1 for the source in use): driver_per_process (NVML), device_used (cuMemGetInfo) or process_rss (cpu).",
        );
        let _ = writeln!(
            out,
            "tether_unaccounted_source{{source=\"{}\"}} 1",
            status.memory_source.as_str()
        );

        header(
            &mut out,
            "tether_process_device_bytes",
            "gauge",
            "Device memory of the worker process as the driver counts it per process (NVML), now and at start; absent when it cannot tell.",
        );
        if status.process_device_bytes > 0 {
            let _ = writeln!(
                out,
                "tether_process_device_bytes{{when=\"now\"}} {}",
                status.process_device_bytes
            );
            let _ = writeln!(
                out,
                "tether_process_device_bytes{{when=\"start\"}} {}",
                status.baseline_process_device_bytes
            );
        }

        header(
            &mut out,
            "tether_process_resident_bytes",
            "gauge",
            "Resident memory of the worker process, now and at start (Linux).",
        );
        for (when, value) in [
            ("now", status.process_rss_bytes),
            ("baseline", status.baseline_rss_bytes),
        ] {
            let _ = writeln!(
                out,
                "tether_process_resident_bytes{{when=\"{when}\"}} {value}"
            );
        }

        header(
            &mut out,
            "tether_draining",
            "gauge",
            "1 while the worker refuses new sessions (draining or shutting down).",
        );
        let _ = writeln!(out, "tether_draining {}", u8::from(status.draining));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_sum_in_seconds() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(300)); // first bucket
        h.observe(Duration::from_millis(3)); // 0.005
        h.observe(Duration::from_secs(20)); // above every bound
        let mut out = String::new();
        h.write(&mut out, "x");
        assert!(out.contains("x_bucket{le=\"0.0005\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.0025\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.005\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"10\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
        let sum: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("x_sum "))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN);
        assert!((sum - 20.0033).abs() < 1e-9, "{sum}");
    }

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

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
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
