//! Staging memory for the small index arrays ops take from the host (token ids, positions,
//! KV cells, attention spans).
//!
//! A pinned host ring and a device ring of the same size: each array is written into the
//! host ring and copied to the same offset of the device ring on the stream, so the copy is
//! truly asynchronous (a pageable copy would wait for the whole stream first). Slots are
//! never reused before the stream has passed them: when the ring wraps, the stream is
//! synchronized first.

use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use crate::backend::Result;
use crate::cuda::device::{CudaBuffer, Device, driver_err};

/// Initial ring size; grows (after a synchronize) when one array is larger.
const INITIAL_BYTES: usize = 1 << 20;
/// Offsets are rounded to this, which suits any element type.
const ALIGN: usize = 256;

/// A page-locked host allocation, freed on drop.
struct PinnedHost {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is owned exclusively by this value; access goes through `&mut self`
// of the owning `Staging`, which sits behind a mutex.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    fn new(device: &Device, len: usize) -> Result<Self> {
        device.bind()?;
        // SAFETY: the context is current; the memory is only written before being read.
        let ptr = unsafe { result::malloc_host(len, 0) }
            .map_err(|e| driver_err(&format!("allocating {len} bytes of pinned host memory"), e))?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host and freed once; the owning `Staging` synchronized
        // the stream before dropping it, so no copy reads it any more.
        let _ = unsafe { result::free_host(self.ptr.cast()) };
    }
}

/// The rings and the next free offset.
pub(crate) struct Staging {
    device: Arc<Device>,
    host: PinnedHost,
    dev: CudaBuffer,
    next: usize,
}

impl Staging {
    pub(crate) fn new(device: &Arc<Device>) -> Result<Self> {
        Ok(Self {
            host: PinnedHost::new(device, INITIAL_BYTES)?,
            dev: device.alloc(INITIAL_BYTES)?,
            device: device.clone(),
            next: 0,
        })
    }

    /// Bytes of device memory the staging ring holds.
    pub(crate) fn device_bytes(&self) -> usize {
        self.host.len
    }

    /// Copies `values` to device memory and returns its address, valid for ops issued on
    /// the stream before the next call that wraps the ring.
    pub(crate) fn stage_u32(&mut self, values: &[u32]) -> Result<CUdeviceptr> {
        let bytes = std::mem::size_of_val(values);
        let size = bytes.max(4).next_multiple_of(ALIGN);
        if self.next + size > self.host.len {
            // Every earlier copy and the ops that read it must finish before reuse.
            self.device.synchronize()?;
            self.next = 0;
            if size > self.host.len {
                let len = size.next_power_of_two();
                self.host = PinnedHost::new(&self.device, len)?;
                self.dev = self.device.alloc(len)?;
            }
        }
        let at = self.next;
        self.next += size;
        // SAFETY: `at + bytes <= host.len`, the host ring is ours, and the slot is unused by
        // any pending copy (see the wrap above).
        let slot = unsafe { std::slice::from_raw_parts_mut(self.host.ptr.add(at), bytes) };
        for (d, v) in slot.chunks_exact_mut(4).zip(values) {
            d.copy_from_slice(&v.to_le_bytes());
        }
        let dst = self.dev.ptr() + at as u64;
        self.device.bind()?;
        // SAFETY: `dst` is inside the device ring; the source is pinned and stays valid
        // until the stream has passed this copy.
        unsafe { result::memcpy_htod_async(dst, &*slot, self.device.stream.cu_stream()) }
            .map_err(|e| driver_err(&format!("staging {bytes} bytes of indices"), e))?;
        Ok(dst)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned ring may still be read by a queued copy.
        let _ = self.device.synchronize();
    }
}
