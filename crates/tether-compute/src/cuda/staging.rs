//! Staging memory for the small index arrays ops take from the host (token ids, positions,
//! KV cells, attention spans), for the hidden states a recorded decode step starts from, and
//! for small downloads.
//!
//! A pinned host ring and a device ring of the same size: each array is written into the
//! host ring and copied to the same offset of the device ring on the stream, so the copy is
//! truly asynchronous (a pageable copy would wait for the whole stream first). Slots are
//! never reused before the stream has passed them: when the ring wraps, the stream is
//! synchronized first.
//!
//! The pinned memory is mapped into the device's address space, and the copies are the
//! `copy_in` kernel reading it rather than copy operations: a recorded step's graph then
//! holds kernels only, and the driver launches such a graph in ~3 us of host time where
//! one holding copy nodes took ~17 us (H100, CUDA 13 driver), paid before every stage's GPU
//! work of every decode step.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaFunction, LaunchConfig, result};

use crate::backend::Result;
use crate::cuda::device::{CudaBuffer, Device, driver_err};
use crate::cuda::graph::Cmd;
use crate::cuda::launch::Arg;

/// Initial ring size; grows (after a synchronize) when one array is larger.
const INITIAL_BYTES: usize = 1 << 20;
/// Offsets are rounded to this, which suits any element type.
const ALIGN: usize = 256;
/// Arrays remembered for reuse: a layer stages the same positions, cells and spans as
/// every other layer of the forward pass, so each is copied once instead of per layer.
const MEMO: usize = 8;

/// A page-locked host allocation, mapped into the device's address space, freed on drop.
pub(crate) struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    /// The device's address of the memory; 0 when the driver would not map it.
    dev: CUdeviceptr,
}

// SAFETY: the pointer is owned exclusively by this value; access goes through `&mut self`
// of the owning `Staging`, which sits behind a mutex.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    pub(crate) fn new(device: &Device, len: usize) -> Result<Self> {
        device.bind()?;
        // SAFETY: the context is current; the memory is only written before being read.
        let ptr = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| driver_err(&format!("allocating {len} bytes of pinned host memory"), e))?;
        let mut dev: CUdeviceptr = 0;
        // SAFETY: `ptr` was just allocated as mapped pinned memory in this context.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr, 0) };
        Ok(Self {
            ptr: ptr.cast(),
            len,
            dev: if mapped == sys::CUresult::CUDA_SUCCESS {
                dev
            } else {
                0
            },
        })
    }

    /// The first `len` bytes. The caller makes sure no queued copy writes them meanwhile.
    pub(crate) fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: `len` is clamped to the allocation, which lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, len.min(self.len)) }
    }

    /// The first `len` bytes, to write. The caller makes sure no queued copy reads them.
    pub(crate) fn bytes_mut(&mut self, len: usize) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len.min(self.len)) }
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
    fn put(
        &mut self,
        device: &Device,
        copier: &Copier,
        values: &[u32],
        size: usize,
    ) -> Result<CUdeviceptr> {
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
        device.submit(copier.copy(dst, &self.host, at, bytes))?;
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
    /// Uploads recorded into a step (its input hidden states), copied from here so the copy
    /// is part of the step's graph; allocated at first use, restarted with the step area.
    uploads: Option<PinnedHost>,
    uploads_next: usize,
    copier: Copier,
}

/// Makes the commands that copy staged bytes to the device.
pub(crate) struct Copier {
    /// The `copy_in` kernel (elementwise.cu), and whether it may be launched dependent.
    kernel: Option<(CudaFunction, bool)>,
}

impl Copier {
    pub(crate) fn new(kernel: Option<(CudaFunction, bool)>) -> Self {
        Self { kernel }
    }

    /// The command copying `bytes` at offset `at` of `host` to device address `dst`: the
    /// `copy_in` kernel reading the mapped memory where it can, else a copy.
    fn copy(&self, dst: CUdeviceptr, host: &PinnedHost, at: usize, bytes: usize) -> Cmd {
        let src = host.ptr as usize + at;
        match &self.kernel {
            Some((func, dependent))
                if host.dev != 0 && (dst | (host.dev + at as u64)).is_multiple_of(16) =>
            {
                let threads = 256u32;
                let blocks = bytes.div_ceil(16 * threads as usize).clamp(1, 64) as u32;
                Cmd::Launch {
                    name: "copy_in".to_string(),
                    func: func.clone(),
                    dependent: *dependent,
                    cfg: LaunchConfig {
                        grid_dim: (blocks, 1, 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    },
                    args: vec![
                        Arg::Ptr(host.dev + at as u64),
                        Arg::Ptr(dst),
                        Arg::U64(bytes as u64),
                    ],
                }
            }
            _ => Cmd::HostToDevice { dst, src, bytes },
        }
    }
}

/// Smallest upload area: eight tokens of a model 8192 wide.
const UPLOAD_BYTES: usize = 256 << 10;

/// Bytes of the step area; a decode step's arrays take a few hundred.
const STEP_BYTES: usize = 64 << 10;

impl Staging {
    pub(crate) fn new(device: &Arc<Device>, copier: Copier) -> Result<Self> {
        Ok(Self {
            copier,
            ring: Area::new(device, INITIAL_BYTES)?,
            step: Area::new(device, STEP_BYTES)?,
            uploads: None,
            uploads_next: 0,
            device: device.clone(),
        })
    }

    /// Restarts the step area once the stream is idle (the last step's copies are done),
    /// so that a step staging the same arrays puts them at the same addresses.
    pub(crate) fn rewind_step(&mut self) -> Result<()> {
        self.device.synchronize()?;
        self.step.restart();
        self.uploads_next = 0;
        Ok(())
    }

    /// Records the copy of `src` to device address `dst` into the step this thread is
    /// recording, from pinned memory, so the step's graph holds the copy and the GPU starts
    /// on it with the step's first piece. False, having done nothing, when the thread is not
    /// recording or the bytes do not fit; the caller then copies them itself.
    pub(crate) fn record_upload(&mut self, dst: CUdeviceptr, src: &[u8]) -> Result<bool> {
        if !self.device.recording_here() {
            return Ok(false);
        }
        let size = src.len().next_multiple_of(ALIGN);
        let fits = |area: &Option<PinnedHost>, at: usize| {
            area.as_ref().is_some_and(|a| at + size <= a.len)
        };
        if !fits(&self.uploads, self.uploads_next) {
            if self.uploads_next != 0 {
                // Earlier uploads of this step may still be read from the area.
                return Ok(false);
            }
            // Nothing of this step is in the area, and the step began with the stream
            // idle: the old area can go.
            self.uploads = None;
            self.uploads = Some(PinnedHost::new(&self.device, size.max(UPLOAD_BYTES))?);
        }
        let at = self.uploads_next;
        let Some(area) = self.uploads.as_mut() else {
            return Ok(false);
        };
        area.bytes_mut(at + size)[at..at + src.len()].copy_from_slice(src);
        self.uploads_next += size;
        self.device
            .submit(self.copier.copy(dst, area, at, src.len()))?;
        Ok(true)
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
                return self.step.put(&self.device, &self.copier, values, size);
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
        self.ring.put(&self.device, &self.copier, values, size)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // The pinned ring may still be read by a queued copy.
        let _ = self.device.synchronize();
    }
}

/// Pinned memory small downloads land in before they are copied out: a copy into pageable
/// memory goes through the driver's own staging and costs several microseconds more, paid
/// by every decode step of every stage.
#[derive(Default)]
pub(crate) struct Bounce(Option<PinnedHost>);

/// Largest download that goes through [`Bounce`]; larger ones are bandwidth, not latency.
pub(crate) const BOUNCE_MAX: usize = 1 << 20;

impl Bounce {
    /// Copies `dst.len()` bytes from device address `src` into `dst`, waiting for the
    /// stream (everything issued before is done when this returns).
    pub(crate) fn download(
        &mut self,
        device: &Device,
        src: CUdeviceptr,
        dst: &mut [u8],
    ) -> Result<()> {
        let len = dst.len();
        if self.0.as_ref().is_none_or(|b| b.len < len) {
            // Every download through here waited for its copy: no queued copy writes the
            // old area.
            self.0 = None;
            self.0 = Some(PinnedHost::new(
                device,
                len.next_power_of_two().max(64 << 10),
            )?);
        }
        let Some(area) = self.0.as_mut() else {
            return Err(crate::error::ComputeError::Device(
                "no pinned memory for a download".to_string(),
            ));
        };
        let landing = area.bytes_mut(len);
        // SAFETY: `landing` is pinned memory of `len` bytes that nothing else touches until
        // the synchronize below has seen the copy done; the caller checked `src` holds
        // `len` bytes.
        unsafe { result::memcpy_dtoh_async(landing, src, device.stream.cu_stream()) }
            .map_err(|e| driver_err(&format!("downloading {len} bytes"), e))?;
        device.synchronize()?;
        dst.copy_from_slice(area.bytes(len));
        Ok(())
    }
}
