//! The CUDA context and stream one backend works on, and device memory owned by values.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::sys::{CUdeviceptr, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DriverError, result};

use crate::backend::{DeviceBuffer, Result};
use crate::error::ComputeError;

/// A driver error while doing `what`, as a [`ComputeError::Driver`].
pub(crate) fn driver_err(what: &str, e: DriverError) -> ComputeError {
    ComputeError::Driver {
        what: what.to_string(),
        source: e,
    }
}

/// What every buffer of one backend shares: the context, the one stream every op and copy
/// runs on (so ops are ordered without events), and the count of bytes allocated.
pub(crate) struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) name: String,
    allocated: AtomicU64,
}

impl Device {
    pub(crate) fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>, name: String) -> Self {
        Self {
            ctx,
            stream,
            name,
            allocated: AtomicU64::new(0),
        }
    }

    /// Makes the context current on the calling thread; every raw driver call needs it.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the CUDA context to this thread", e))
    }

    /// Waits for every op issued on the stream.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.flush_recorded()?;
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| driver_err("waiting for the CUDA stream", e))
    }

    /// Bytes currently allocated through this device by live buffers.
    pub(crate) fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Free and total device memory, from cuMemGetInfo.
    pub(crate) fn mem_info(&self) -> Result<(u64, u64)> {
        self.bind()?;
        let (free, total) =
            result::mem_get_info().map_err(|e| driver_err("reading device memory info", e))?;
        Ok((free as u64, total as u64))
    }

    /// Allocates `bytes` zeroed bytes (zeros like the cpu backend, so reading before writing
    /// is defined).
    pub(crate) fn alloc(self: &Arc<Self>, bytes: usize) -> Result<CudaBuffer> {
        if bytes == 0 {
            return Ok(CudaBuffer::empty(self));
        }
        let ptr = self.alloc_raw(bytes)?;
        Ok(CudaBuffer {
            ptr,
            len: bytes,
            device: self.clone(),
            block: None,
            packed: false,
        })
    }

    /// Buffers of `sizes` carved out of one allocation (each starting on a 256-byte
    /// boundary, as cuMemAlloc's own do), freed when the last of them is dropped. The
    /// driver hands out memory in 2 MiB pages: hundreds of tensors allocated one by one
    /// would each round up, and the device would show hundreds of MiB more in use than
    /// the session holds.
    pub(crate) fn alloc_many(self: &Arc<Self>, sizes: &[usize]) -> Result<Vec<CudaBuffer>> {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0usize;
        for &s in sizes {
            offsets.push(total);
            total = total
                .checked_add(s.next_multiple_of(BLOCK_ALIGN))
                .ok_or_else(|| ComputeError::Shape {
                    op: "alloc",
                    detail: format!("{} buffers overflow the address space", sizes.len()),
                })?;
        }
        if total == 0 {
            return Ok(sizes.iter().map(|_| CudaBuffer::empty(self)).collect());
        }
        let ptr = self.alloc_raw(total)?;
        let block = Arc::new(Block {
            ptr,
            len: total,
            device: self.clone(),
        });
        Ok(sizes
            .iter()
            .zip(offsets)
            .map(|(&len, off)| {
                if len == 0 {
                    CudaBuffer::empty(self)
                } else {
                    CudaBuffer {
                        ptr: ptr + off as u64,
                        len,
                        device: self.clone(),
                        block: Some(block.clone()),
                        packed: false,
                    }
                }
            })
            .collect())
    }

    /// `bytes` (> 0) of zeroed device memory, counted in `allocated`; the caller frees it
    /// with [`Device::free_raw`].
    fn alloc_raw(&self, bytes: usize) -> Result<CUdeviceptr> {
        self.flush_recorded()?;
        self.bind()?;
        // SAFETY: the context is current; the memory is zeroed below before any use.
        let ptr = match unsafe { result::malloc_sync(bytes) } {
            Ok(p) => p,
            Err(e) if e.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let free = self.mem_info().map(|(f, _)| f).unwrap_or(0);
                return Err(ComputeError::OutOfMemory {
                    device: self.name.clone(),
                    requested: bytes as u64,
                    free,
                });
            }
            Err(e) => return Err(driver_err(&format!("allocating {bytes} bytes"), e)),
        };
        self.allocated.fetch_add(bytes as u64, Ordering::Relaxed);
        // SAFETY: `ptr` holds `bytes` bytes; the memset is ordered on the stream before any
        // op that uses the memory.
        if let Err(e) = unsafe { result::memset_d8_async(ptr, 0, bytes, self.stream.cu_stream()) } {
            self.free_raw(ptr, bytes);
            return Err(driver_err(&format!("zeroing {bytes} new bytes"), e));
        }
        Ok(ptr)
    }

    /// Frees what [`Device::alloc_raw`] gave, once every op that may use it has finished.
    fn free_raw(&self, ptr: CUdeviceptr, bytes: usize) {
        // A kernel still queued may use this memory: wait for the stream before freeing.
        // Errors here cannot be returned; a failed sync means the context is broken, and
        // freeing then is still the best that can be done.
        let _ = self.synchronize();
        crate::shared::forget_lent(ptr);
        // SAFETY: `ptr` came from malloc_sync, is freed once, and the stream is idle.
        let _ = unsafe { result::free_sync(ptr) };
        self.allocated.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
}

/// Alignment of each buffer inside a shared block (cuMemAlloc's own alignment).
const BLOCK_ALIGN: usize = 256;

/// One allocation shared by the buffers of [`Device::alloc_many`]; freed with the last.
struct Block {
    ptr: CUdeviceptr,
    len: usize,
    device: Arc<Device>,
}

impl Drop for Block {
    fn drop(&mut self) {
        self.device.free_raw(self.ptr, self.len);
    }
}

/// A block of device memory owned by one value; dropping it waits for the backend's stream
/// and frees the memory.
pub struct CudaBuffer {
    ptr: CUdeviceptr,
    len: usize,
    device: Arc<Device>,
    /// The shared allocation this buffer is part of (freed with the last part), or `None`
    /// when the buffer owns its memory.
    block: Option<Arc<Block>>,
    /// Whether its Q4_0 / Q8_0 rows were rewritten in the packed layout
    /// (kernels/matvec_packed.cu) by `finish_weight`.
    pub(crate) packed: bool,
}

impl CudaBuffer {
    fn empty(device: &Arc<Device>) -> CudaBuffer {
        CudaBuffer {
            ptr: 0,
            len: 0,
            device: device.clone(),
            block: None,
            packed: false,
        }
    }

    /// The device address (0 for an empty buffer).
    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The allocation the buffer lies in: its address and size (the buffer's own unless it
    /// is a part of a shared block).
    pub(crate) fn allocation(&self) -> (CUdeviceptr, usize) {
        match &self.block {
            Some(b) => (b.ptr, b.len),
            None => (self.ptr, self.len),
        }
    }

    /// Whether the buffer was allocated by the device `d`.
    pub(crate) fn belongs_to(&self, d: &Arc<Device>) -> bool {
        Arc::ptr_eq(&self.device, d)
    }
}

impl DeviceBuffer for CudaBuffer {
    fn bytes(&self) -> usize {
        self.len
    }
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaBuffer({} bytes on {})", self.len, self.device.name)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        // A part of a shared block is freed with the block (when its last part goes).
        if self.len == 0 || self.block.is_some() {
            return;
        }
        self.device.free_raw(self.ptr, self.len);
    }
}
