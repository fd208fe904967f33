//! Where one worker's Prepare spent its time, sent back with its yes vote so the
//! coordinator can show a load's split (`tether run --timings`, debug logs).

use std::time::Duration;

/// The phases of one Prepare on the worker. They add up to the Prepare's time on the
/// worker, less the gaps between them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrepareTimings {
    /// Parsing the header and planning the block.
    pub plan: Duration,
    /// Admission and allocating the block's memory.
    pub allocate: Duration,
    /// Waiting for tensor bytes: chunks from the network, or the pages of the worker's own
    /// copy of the file (a cold page cache shows here).
    pub read: Duration,
    /// Computing CRC-32s of the tensor bytes.
    pub checksum: Duration,
    /// Copying the tensor bytes to the device, including waiting for queued copies.
    pub upload: Duration,
    /// Verifying the block, rewriting weights into the device's layout, synchronizing.
    pub finish: Duration,
    /// Tensor bytes staged.
    pub tensor_bytes: u64,
}

impl PrepareTimings {
    /// The sum of the phases.
    pub fn total(&self) -> Duration {
        self.plan + self.allocate + self.read + self.checksum + self.upload + self.finish
    }
}

/// Bytes per second as GB/s (10^9 bytes), 0 for an empty interval.
pub fn gb_per_s(bytes: u64, took: Duration) -> f64 {
    let secs = took.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    bytes as f64 / secs / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn total_adds_every_phase_and_throughput_handles_zero() {
        let ms = Duration::from_millis;
        let t = PrepareTimings {
            plan: ms(1),
            allocate: ms(2),
            read: ms(3),
            checksum: ms(4),
            upload: ms(5),
            finish: ms(6),
            tensor_bytes: 2_000_000_000,
        };
        assert_eq!(t.total(), ms(21));
        assert_eq!(gb_per_s(2_000_000_000, Duration::from_secs(2)), 1.0);
        assert_eq!(gb_per_s(5, Duration::ZERO), 0.0);
    }
}
