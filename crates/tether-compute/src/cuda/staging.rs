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
use crate::cuda::graph::Cmd;

/// Initial ring size; grows (after a synchronize) when one array is larger.
const INITIAL_BYTES: usize = 1 << 20;
/// Offsets are rounded to this, which suits any element type.
const ALIGN: usize = 256;
/// Arrays remembered for reuse: a layer stages the same positions, cells and spans as
/// every other layer of the forward pass, so each is copied once instead of per layer.
const MEMO: usize = 8;

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

/// A pinned host area, the device area it is copied to, the next free offset, and the
/// arrays staged since the last restart.
struct Area {
    host: PinnedHost,
    dev: CudaBuffer,
    next: usize,
    /// Recently staged arrays and where they are; all still unoverwritten (cleared on
    /// restart). A layer stages the same positions, cells and spans as every other layer.
    memo: Vec<(Vec<u32>, CUdeviceptr)>,
}

impl Area {
    fn new(device: &Arc<Device>, len: usize) -> Result<Self> {
        Ok(Self {
            host: PinnedHost::new(device, len)?,
            dev: device.alloc(len)?,
            next: 0,
            memo: Vec::with_capacity(MEMO),
        })
    }

    fn restart(&mut self) {
        self.next = 0;
        self.memo.clear();
    }

    fn find(&self, values: &[u32]) -> Option<CUdeviceptr> {
        self.memo
            .iter()
            .find(|(v, _)| v.as_slice() == values)
            .map(|(_, at)| *at)
    }

    /// Writes `values` at the next free offset and records or issues their copy; the
    /// caller checked that `size` bytes are free.
    fn put(&mut self, device: &Device, values: &[u32], size: usize) -> Result<CUdeviceptr> {
        let bytes = std::mem::size_of_val(values);
        let at = self.next;
        self.next += size;
        // SAFETY: `at + bytes <= host.len` (checked by the caller), the host area is ours,
        // and the slot is unused by any pending copy (the area restarts only when the
        // stream is idle).
        let slot = unsafe { std::slice::from_raw_parts_mut(self.host.ptr.add(at), bytes) };
        for (d, v) in slot.chunks_exact_mut(4).zip(values) {
            d.copy_from_slice(&v.to_le_bytes());
        }
        let dst = self.dev.ptr() + at as u64;
        // The source is pinned and stays valid until the stream has passed this copy.
        device.submit(Cmd::HostToDevice {
            dst,
            src: slot.as_ptr() as usize,
            bytes,
        })?;
        if self.memo.len() == MEMO {
            self.memo.remove(0);
        }
        self.memo.push((values.to_vec(), dst));
        Ok(dst)
    }
}

/// The ring for ordinary ops, and a fixed area for recorded decode steps: a step's arrays
/// must sit at the same addresses every time for its graph to be replayed (graph.rs).
pub(crate) struct Staging {
    device: Arc<Device>,
    ring: Area,
    step: Area,
}

/// Bytes of the step area; a decode step's arrays take a few hundred.
const STEP_BYTES: usize = 64 << 10;

impl Staging {
    pub(crate) fn new(device: &Arc<Device>) -> Result<Self> {
        Ok(Self {
            ring: Area::new(device, INITIAL_BYTES)?,
            step: Area::new(device, STEP_BYTES)?,
            device: device.clone(),
        })
    }

    /// Restarts the step area once the stream is idle (the last step's copies are done),
    /// so that a step staging the same arrays puts them at the same addresses.
    pub(crate) fn rewind_step(&mut self) -> Result<()> {
        self.device.synchronize()?;
        self.step.restart();
        Ok(())
    }

    /// Bytes of device memory the staging areas hold.
    pub(crate) fn device_bytes(&self) -> usize {
        self.ring.host.len + self.step.host.len
    }

    /// Copies `values` to device memory and returns its address, valid for ops issued on
    /// the stream before the next call that wraps the ring.
    pub(crate) fn stage_u32(&mut self, values: &[u32]) -> Result<CUdeviceptr> {
        let size = std::mem::size_of_val(values).max(4).next_multiple_of(ALIGN);
        if self.device.recording_here() {
            if let Some(at) = self.step.find(values) {
                return Ok(at);
            }
            if self.step.next + size <= self.step.host.len {
                return self.step.put(&self.device, values, size);
            }
            // Too large for the step area: the step runs eagerly from the ring instead.
            self.device.flush_recorded()?;
        }
        if let Some(at) = self.ring.find(values) {
            return Ok(at);
        }
        if self.ring.next + size > self.ring.host.len {
            // Every earlier copy and the ops that read it must finish before reuse.
            self.device.synchronize()?;
            self.ring.restart();
            if size > self.ring.host.len {
                self.ring = Area::new(&self.device, size.next_power_of_two())?;
            }
        }
        self.ring.put(&self.device, values, size)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned ring may still be read by a queued copy.
        let _ = self.device.synchronize();
    }
}
