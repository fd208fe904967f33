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
    /// The lender's random key for the allocation: a borrower in the lending process takes
    /// the address only with it, so an address alone names no other session's memory.
    pub key: u64,
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
            && self.key == other.key
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

/// The allocations this process lent, each with its random key (see [`SharedArea::key`]).
/// Only addresses and numbers: the memory stays owned by the buffers that hold it, and an
/// allocation leaves the registry when it is freed ([`forget_lent`]).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
static LENT: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn lent_registry() -> std::sync::MutexGuard<'static, Vec<(u64, u64)>> {
    LENT.lock().unwrap_or_else(|p| p.into_inner())
}

/// The key of the allocation at `base`, made the first time it is lent.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn lend_key(base: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut lent = lent_registry();
    if let Some(&(_, key)) = lent.iter().find(|(b, _)| *b == base) {
        return key;
    }
    // RandomState is seeded from the OS's randomness once per process, and each new one
    // from there on differs.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(base);
    let key = h.finish();
    lent.push((base, key));
    key
}

/// Whether this process lent the allocation at `base` under `key`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn lent_here(base: u64, key: u64) -> bool {
    lent_registry().iter().any(|&(b, k)| b == base && k == key)
}

/// Forgets the allocation at `base` (freed): its address may come back for other memory.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn forget_lent(base: u64) {
    lent_registry().retain(|&(b, _)| b != base);
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
    fn a_lent_allocation_is_known_by_its_key_until_freed() {
        let base = 0x7f12_3400_0000;
        let key = lend_key(base);
        assert_eq!(lend_key(base), key, "one key an allocation");
        assert!(lent_here(base, key));
        assert!(!lent_here(base, key ^ 1), "a wrong key");
        assert!(!lent_here(base + 256, key), "another address");
        assert_ne!(lend_key(base + 4096), key, "each allocation its own key");
        forget_lent(base);
        forget_lent(base + 4096);
        assert!(!lent_here(base, key), "forgotten once freed");
    }

    #[test]
    fn a_prefix_stays_inside_its_range() {
        let area = SharedArea {
            host: [1; 16],
            pid: 7,
            device: 0,
            handle: [2; HANDLE_BYTES],
            base: 4096,
            key: 99,
            offset: 256,
            len: 1024,
        };
        assert_eq!(area.prefix(512).expect("inside").len, 512);
        assert!(area.prefix(1025).is_err());
        assert!(area.same_allocation(&SharedArea { offset: 0, ..area }));
        assert!(!area.same_allocation(&SharedArea { pid: 8, ..area }));
        assert!(!area.same_allocation(&SharedArea { key: 98, ..area }));
    }
}
