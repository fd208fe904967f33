//! What both ends agree about a session: its lease, and why and how it ended. The
//! lifecycle itself lives on the worker (`tether_worker::session`).

use std::fmt;
use std::time::Duration;

/// How often a client heartbeats and how long the worker waits for one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Interval between heartbeats, both ways.
    pub heartbeat_interval: Duration,
    /// A session with no client heartbeat for this long is reaped.
    pub ttl: Duration,
}

/// Why a session ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EndReason {
    /// The client closed it.
    Closed,
    /// The stream ended or failed without a close.
    Disconnected,
    /// No heartbeat within the TTL.
    Reaped,
    /// An operator killed it.
    Killed,
    /// The worker shut down.
    Shutdown,
}

impl EndReason {
    /// The reason's name in logs and status.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Disconnected => "disconnected",
            Self::Reaped => "reaped",
            Self::Killed => "killed",
            Self::Shutdown => "shutdown",
        }
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a session ended: the reason and the bytes it held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionEnd {
    /// Why.
    pub reason: EndReason,
    /// Bytes freed with it.
    pub bytes_freed: u64,
}
