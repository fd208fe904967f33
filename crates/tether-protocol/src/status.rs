//! What the worker reports about itself: counters, memory and sessions.

use serde::Serialize;

/// Lifetime counters of a worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CounterValues {
    /// Sessions opened.
    pub opened: u64,
    /// Ended by the client's close.
    pub closed: u64,
    /// Ended by the stream ending or failing.
    pub disconnected: u64,
    /// Ended by the reaper (no heartbeat within TTL).
    pub reaped: u64,
    /// Ended by an admin kill.
    pub killed: u64,
    /// Ended by worker shutdown.
    pub shutdown: u64,
    /// Prepared transactions aborted because no decision came in time.
    pub txn_timed_out: u64,
}

/// What a worker's `unaccounted_bytes` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemorySource {
    /// The process's resident memory over its start value (cpu device).
    ProcessRss,
    /// The process's device memory as the driver counts it per process (NVML).
    DriverPerProcess,
    /// The whole device's used memory over its value at start (cuMemGetInfo): other
    /// processes on the device move it too.
    DeviceUsed,
}

impl MemorySource {
    /// The name used on the wire, in JSON and in `tetherctl status`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemorySource::ProcessRss => "process_rss",
            MemorySource::DriverPerProcess => "driver_per_process",
            MemorySource::DeviceUsed => "device_used",
        }
    }

    /// The source named `s`; an unknown or empty name (an older worker) reads as the
    /// device's used memory, the only source such a worker had on a GPU.
    pub fn parse(s: &str) -> Self {
        match s {
            "process_rss" => MemorySource::ProcessRss,
            "driver_per_process" => MemorySource::DriverPerProcess,
            _ => MemorySource::DeviceUsed,
        }
    }
}

/// A worker's state as `tetherctl status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerStatus {
    /// The worker's build.
    pub worker_version: String,
    /// The device served.
    pub device: String,
    /// Device memory in all, as the driver reports it.
    pub device_total_bytes: u64,
    /// Device memory free now.
    pub device_free_bytes: u64,
    /// Device memory in use when the worker started.
    pub baseline_used_bytes: u64,
    /// The admission limit.
    pub max_memory_bytes: u64,
    /// Live sessions.
    pub sessions: u32,
    /// Bytes held by all sessions.
    pub session_bytes: u64,
    /// Bytes held beyond the idle baseline and session bytes, as `memory_source` counts
    /// them.
    pub unaccounted_bytes: u64,
    /// Where `unaccounted_bytes` comes from.
    pub memory_source: MemorySource,
    /// Device bytes of this process as the driver counts them per process (NVML); 0 when
    /// it cannot tell.
    pub process_device_bytes: u64,
    /// `process_device_bytes` when the worker started; 0 when the driver could not tell.
    pub baseline_process_device_bytes: u64,
    /// Lifetime counters.
    pub counters: CounterValues,
    /// New sessions are refused.
    pub draining: bool,
    /// Seconds since start.
    pub uptime_s: u64,
    /// Resident memory of the worker process.
    pub process_rss_bytes: u64,
    /// Resident memory of the worker process when it started, before any session.
    pub baseline_rss_bytes: u64,
}

/// One live session as `tetherctl sessions` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct SessionSummary {
    /// Session id.
    pub session_id: String,
    /// The client's name.
    pub client_name: String,
    /// Bytes held.
    pub bytes: u64,
    /// Layers served ("0..6", last excluded), empty when nothing is committed.
    pub layers: String,
    /// Lease TTL.
    pub ttl_ms: u32,
    /// Milliseconds since the last client heartbeat.
    pub last_heartbeat_ms_ago: u64,
    /// Milliseconds since the session opened.
    pub age_ms: u64,
    /// Transactions waiting for a decision.
    pub prepared_txns: u32,
    /// Blocks of the committed block's paged KV pool (0 before a Commit, or without layers).
    pub kv_blocks: u64,
    /// Of those, the blocks no sequence holds.
    pub kv_blocks_free: u64,
}
