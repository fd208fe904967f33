//! Lending a buffer's allocation to another backend on this machine (CUDA IPC, or the
//! address itself inside one process) and copying from a lent range, GPU to GPU: a
//! pipeline's hidden states skip the host (see [`crate::Backend::share`]).

use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

use super::check::need;
use super::device::Device;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};
use crate::error::ComputeError;
use crate::shared::{HANDLE_BYTES, SharedArea, host_id, lend_key, lent_here};

/// An allocation another backend lent, opened in this one's context.
pub struct Borrowed {
    /// Where the allocation starts, as this backend addresses it.
    addr: CUdeviceptr,
    /// Its size in bytes.
    len: u64,
    /// The area it was opened for: copies name ranges of the same allocation.
    area: SharedArea,
    /// Set when it was opened through IPC: closed on drop with this context bound.
    mapped_by: Option<Arc<Device>>,
    /// Set when the lender is another device of this process: the primary context retained
    /// to allow peer access, released on drop.
    peer_device: Option<sys::CUdevice>,
}

fn not_shared(what: &str, e: CUresult) -> ComputeError {
    ComputeError::NotShared(format!("{what}: CUDA driver error {e:?}"))
}

impl CudaBackend {
    /// [`crate::Backend::share`]: the handle of the allocation `buf` lies in.
    pub(super) fn lend(&self, buf: &CudaBuffer) -> Result<SharedArea> {
        let host = host_id().ok_or_else(|| {
            ComputeError::NotShared("this machine has no boot id to name its areas".into())
        })?;
        if buf.bytes() == 0 {
            return Err(ComputeError::NotShared("an empty buffer".into()));
        }
        let ptr = self.addr("share", "buffer", buf)?;
        let (base, _) = buf.allocation();
        self.device.bind()?;
        let mut handle = sys::CUipcMemHandle_st {
            reserved: [0; HANDLE_BYTES],
        };
        // SAFETY: `base` is the start of a live cuMemAlloc allocation of this context.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
            .result()
            .map_err(|e| not_shared("lending an allocation", e.0))?;
        Ok(SharedArea {
            host,
            pid: std::process::id(),
            device: self.device.ctx.ordinal() as u32,
            handle: handle.reserved.map(|b| b as u8),
            base,
            key: lend_key(base),
            offset: ptr - base,
            len: buf.bytes() as u64,
        })
    }

    /// [`crate::Backend::open_shared`].
    pub(super) fn borrow(&self, area: &SharedArea) -> Result<Borrowed> {
        if host_id() != Some(area.host) {
            return Err(ComputeError::NotShared(
                "the area was lent on another machine".into(),
            ));
        }
        self.device.bind()?;
        if area.pid != std::process::id() {
            return self.open_ipc(area);
        }
        if !lent_here(area.base, area.key) {
            return Err(ComputeError::NotShared(
                "this process lent no allocation by that address and key".into(),
            ));
        }
        let peer_device = self.allow_peer(area.device)?;
        let mut view = Borrowed {
            addr: area.base,
            len: 0,
            area: *area,
            mapped_by: None,
            peer_device,
        };
        // A named address of this process must be the start of one of its allocations:
        // a copy from anywhere else could read memory no session lent.
        let (start, len) = range_of(area.base)?;
        if start != area.base {
            return Err(ComputeError::NotShared(format!(
                "address {:#x} does not start an allocation",
                area.base
            )));
        }
        view.len = len;
        Ok(view)
    }

    fn open_ipc(&self, area: &SharedArea) -> Result<Borrowed> {
        let handle = sys::CUipcMemHandle_st {
            reserved: area.handle.map(|b| b as _),
        };
        let mut addr: CUdeviceptr = 0;
        // SAFETY: the context is current; the handle is opaque bytes the driver checks.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut addr,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| not_shared("opening a lent allocation", e.0))?;
        let mut view = Borrowed {
            addr,
            len: 0,
            area: *area,
            mapped_by: Some(self.device.clone()),
            peer_device: None,
        };
        view.len = range_of(addr)?.1;
        Ok(view)
    }

    /// Lets this context read device `ordinal`'s memory directly when the two can (NVLink
    /// or PCIe peer access); without it the driver copies through the host.
    fn allow_peer(&self, ordinal: u32) -> Result<Option<sys::CUdevice>> {
        if ordinal as usize == self.device.ctx.ordinal() {
            return Ok(None);
        }
        let mut peer: sys::CUdevice = 0;
        let mut can = 0;
        // SAFETY: plain queries with out-pointers to locals.
        unsafe {
            sys::cuDeviceGet(&mut peer, ordinal as i32)
                .result()
                .map_err(|e| not_shared("finding the lending device", e.0))?;
            sys::cuDeviceCanAccessPeer(&mut can, self.device.ctx.cu_device(), peer)
                .result()
                .map_err(|e| not_shared("asking for peer access", e.0))?;
        }
        if can == 0 {
            return Ok(None);
        }
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: retains the peer's primary context (released in Borrowed's drop); this
        // context is current for the enable.
        unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, peer)
                .result()
                .map_err(|e| not_shared("retaining the lending device's context", e.0))?;
            match sys::cuCtxEnablePeerAccess(ctx, 0) {
                CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => {
                    let _ = sys::cuDevicePrimaryCtxRelease_v2(peer);
                    return Err(not_shared("enabling peer access", e));
                }
            }
        }
        Ok(Some(peer))
    }

    /// [`crate::Backend::copy_shared`].
    pub(super) fn copy_borrowed(
        &self,
        view: &Borrowed,
        area: &SharedArea,
        dst: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "copy_shared";
        if !view.area.same_allocation(area) {
            return Err(ComputeError::NotShared(
                "the area lies in another allocation than the one opened".into(),
            ));
        }
        let end = area.offset.checked_add(area.len);
        if end.is_none_or(|e| e > view.len) {
            return Err(ComputeError::Shape {
                op: OP,
                detail: format!(
                    "{} bytes at {} of a lent allocation of {}",
                    area.len, area.offset, view.len
                ),
            });
        }
        let len = area.len as usize;
        need(OP, "destination buffer", dst.bytes(), Some(len))?;
        let to = self.addr(OP, "destination", dst)?;
        self.before_copy()?;
        if len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: the source range lies inside the opened allocation and the destination
        // inside `dst` (both checked); the lender keeps the range unchanged until this
        // stream has passed the copy (the caller's contract).
        unsafe {
            sys::cuMemcpyAsync(
                to,
                view.addr + area.offset,
                len,
                self.device.stream.cu_stream(),
            )
        }
        .result()
        .map_err(|e| super::device::driver_err("copying a lent range", e))
    }
}

/// The start and size of the allocation `addr` lies in.
fn range_of(addr: CUdeviceptr) -> Result<(CUdeviceptr, u64)> {
    let mut start: CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers to locals of the attribute's type.
    unsafe {
        sys::cuPointerGetAttribute(
            (&mut start as *mut CUdeviceptr).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            addr,
        )
        .result()
        .map_err(|e| not_shared("finding a lent allocation", e.0))?;
        sys::cuPointerGetAttribute(
            (&mut size as *mut usize).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            addr,
        )
        .result()
        .map_err(|e| not_shared("sizing a lent allocation", e.0))?;
    }
    Ok((start, size as u64))
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(device) = &self.mapped_by {
            // A queued copy may still read the mapping. Errors cannot be returned here; a
            // failed sync means the context is broken, and closing is still the best left.
            let _ = device.synchronize();
            // SAFETY: `addr` came from cuIpcOpenMemHandle in this context and is closed once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.addr) };
        }
        if let Some(peer) = self.peer_device {
            // SAFETY: balances the retain in `allow_peer`.
            let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(peer) };
        }
    }
}
