//! Host memory for the cpu backend: 64-byte aligned, zero-initialised, freed on drop.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

use crate::backend::{DeviceBuffer, MemoryInfo};
use crate::error::ComputeError;

/// Alignment of every [`CpuBuffer`]: one cache line, and enough for any SIMD load.
pub const CPU_BUFFER_ALIGN: usize = 64;

/// A block of host memory owned by one value; dropping it frees the memory.
///
/// The memory starts zeroed, so reading a buffer before writing it is defined (zeros).
pub struct CpuBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// For a finished Q4_0 weight rewritten into the packed layout (`matmul::packed`), its
    /// row length in bytes: only this backend's ops read it, and it is not written again.
    pub(crate) packed: Option<usize>,
}

// SAFETY: the buffer exclusively owns its allocation (like a `Box<[u8]>`); shared access
// only hands out `&[u8]`, mutable access needs `&mut self`.
unsafe impl Send for CpuBuffer {}
// SAFETY: see `Send`; there is no interior mutability.
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    /// Allocates `bytes` zeroed bytes, or `None` when the allocator refuses (or the size
    /// does not form a valid layout).
    pub(crate) fn try_new(bytes: usize) -> Option<Self> {
        if bytes == 0 {
            // A zero-sized allocation is not allowed; an aligned dangling pointer is valid
            // for zero-length slices.
            let ptr = NonNull::new(CPU_BUFFER_ALIGN as *mut u8)?;
            return Some(Self {
                ptr,
                len: 0,
                packed: None,
            });
        }
        let layout = Layout::from_size_align(bytes, CPU_BUFFER_ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        NonNull::new(raw).map(|ptr| Self {
            ptr,
            len: bytes,
            packed: None,
        })
    }

    /// The whole buffer as bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised (zeroed at allocation) bytes that
        // this value owns.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer as mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer as `f32` values (`bytes / 4` of them; a trailing partial value is left out).
    pub fn as_f32(&self) -> &[f32] {
        // SAFETY: the pointer is 64-byte aligned, every bit pattern is a valid f32, and the
        // length stays inside the allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<f32>(), self.len / 4) }
    }

    /// The buffer as mutable `f32` values (`bytes / 4` of them).
    pub fn as_f32_mut(&mut self) -> &mut [f32] {
        // SAFETY: as in `as_f32`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<f32>(), self.len / 4) }
    }
}

impl DeviceBuffer for CpuBuffer {
    fn bytes(&self) -> usize {
        self.len
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if let Ok(layout) = Layout::from_size_align(self.len, CPU_BUFFER_ALIGN) {
            // SAFETY: allocated in `try_new` with exactly this layout and not freed since.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBuffer")
            .field("bytes", &self.len)
            .field("packed", &self.packed)
            .finish()
    }
}

/// Total and available system memory from `/proc/meminfo` (`MemTotal`, `MemAvailable`).
pub(crate) fn system_memory() -> Result<MemoryInfo, ComputeError> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| {
        ComputeError::Device(format!(
            "reading /proc/meminfo for the cpu backend's memory info: {e}; \
             the cpu backend needs Linux procfs to report memory"
        ))
    })?;
    parse_meminfo(&text).ok_or_else(|| {
        ComputeError::Device(
            "/proc/meminfo lacks MemTotal or MemAvailable (kernel older than 3.14?)".to_string(),
        )
    })
}

/// Extracts `MemTotal` and `MemAvailable` (kB in the file) as bytes.
fn parse_meminfo(text: &str) -> Option<MemoryInfo> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let rest = line.get(name.len()..)?.trim_start_matches(':').trim();
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        kb.checked_mul(1024)
    };
    Some(MemoryInfo {
        total: field("MemTotal")?,
        free: field("MemAvailable")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_aligned_zeroed_and_writable() {
        for bytes in [0usize, 1, 63, 64, 4096 + 3] {
            let mut b = CpuBuffer::try_new(bytes).unwrap();
            assert_eq!(b.bytes(), bytes);
            assert_eq!(b.as_bytes().as_ptr() as usize % CPU_BUFFER_ALIGN, 0);
            assert!(b.as_bytes().iter().all(|v| *v == 0));
            assert_eq!(b.as_f32().len(), bytes / 4);
            b.as_bytes_mut().iter_mut().for_each(|v| *v = 0xAB);
            assert!(b.as_bytes().iter().all(|v| *v == 0xAB));
        }
    }

    #[test]
    fn impossible_sizes_are_refused_not_aborted() {
        assert!(CpuBuffer::try_new(usize::MAX - 10).is_none());
    }

    #[test]
    fn meminfo_parses_total_and_available() {
        let text = "MemTotal:       16000 kB\nMemFree:  100 kB\nMemAvailable:    8000 kB\n";
        let info = parse_meminfo(text).unwrap();
        assert_eq!(info.total, 16000 * 1024);
        assert_eq!(info.free, 8000 * 1024);
        assert!(parse_meminfo("MemTotal: 5 kB\n").is_none());
        let live = system_memory().unwrap();
        assert!(live.total > 0 && live.free <= live.total);
    }
}
