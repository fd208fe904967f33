//! Device memory one backend lends another on the same machine, named by a [`SharedArea`]:
//! a pipeline's hidden states go from one GPU to the next without passing through the
//! host (see [`crate::Backend::share`]).

use crate::error::ComputeError;

/// Bytes of a driver's handle to an allocation (CUDA's `CUipcMemHandle`).
pub const HANDLE_BYTES: usize = 64;

/// A range of device memory another backend can copy from: the allocation's handle, and
/// where the range lies in it. It names memory only; the lender keeps it alive and unchanged
/// for as long as the borrower may read it (a pipeline hands a slot on and takes it back).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedArea {
    /// The machine's boot id: areas are only opened on the machine that lent them.
    pub host: [u8; 16],
    /// The lending process.
    pub pid: u32,
    /// The lending device's ordinal.
    pub device: u32,
    /// The driver's handle to the allocation the range lies in.
    pub handle: [u8; HANDLE_BYTES],
    /// The allocation's address in the lending process (used when the borrower is that
    /// process, which cannot open its own handle).
    pub base: u64,
    /// Where the range starts in the allocation.
    pub offset: u64,
    /// Bytes in the range.
    pub len: u64,
}

impl SharedArea {
    /// The same allocation: one opened view serves every range of it.
    pub fn same_allocation(&self, other: &SharedArea) -> bool {
        self.host == other.host
            && self.pid == other.pid
            && self.device == other.device
            && self.handle == other.handle
            && self.base == other.base
    }

    /// The first `len` bytes of this range.
    pub fn prefix(&self, len: u64) -> Result<SharedArea, ComputeError> {
        if len > self.len {
            return Err(ComputeError::Shape {
                op: "shared area",
                detail: format!("{len} bytes asked of a range of {}", self.len),
            });
        }
        Ok(SharedArea { len, ..*self })
    }
}

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`), `None` where there is none
/// to read: then nothing is lent or borrowed.
pub fn host_id() -> Option<[u8; 16]> {
    static ID: std::sync::OnceLock<Option<[u8; 16]>> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        parse_boot_id(&text)
    })
}

/// The 16 bytes of a boot id written as a UUID.
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_ids_parse_as_uuids_and_nothing_else() {
        let id = parse_boot_id("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").expect("a uuid");
        assert_eq!(id[0], 0x0f);
        assert_eq!(id[15], 0xf0);
        assert!(parse_boot_id("0f1e2d3c-4b5a").is_none());
        assert!(parse_boot_id("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0").is_none());
    }

    #[test]
    fn a_prefix_stays_inside_its_range() {
        let area = SharedArea {
            host: [1; 16],
            pid: 7,
            device: 0,
            handle: [2; HANDLE_BYTES],
            base: 4096,
            offset: 256,
            len: 1024,
        };
        assert_eq!(area.prefix(512).expect("inside").len, 512);
        assert!(area.prefix(1025).is_err());
        assert!(area.same_allocation(&SharedArea { offset: 0, ..area }));
        assert!(!area.same_allocation(&SharedArea { pid: 8, ..area }));
    }
}
