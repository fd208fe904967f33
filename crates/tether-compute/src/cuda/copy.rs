//! Device-to-device copies on the backend's stream: one buffer into another, and ranges
//! inside one buffer (KV cells moved from one sequence's region to another's for prefix
//! reuse).

use cudarc::driver::result;

use super::check::need;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};
use crate::cuda::device::driver_err;

impl CudaBackend {
    /// [`crate::Backend::copy`] on the device.
    pub(super) fn copy_between(
        &self,
        src: &CudaBuffer,
        dst: &mut CudaBuffer,
        bytes: usize,
    ) -> Result<()> {
        const OP: &str = "copy";
        self.before_copy()?;
        need(OP, "source buffer", src.bytes(), Some(bytes))?;
        need(OP, "destination buffer", dst.bytes(), Some(bytes))?;
        let (s, d) = (
            self.addr(OP, "source", src)?,
            self.addr(OP, "destination", dst)?,
        );
        self.memcpy(d, s, bytes)
    }

    /// [`crate::Backend::copy_within`] on the device.
    pub(super) fn copy_inside(
        &self,
        buf: &mut CudaBuffer,
        src: usize,
        dst: usize,
        bytes: usize,
    ) -> Result<()> {
        const OP: &str = "copy_within";
        self.before_copy()?;
        crate::shape_check::copy_within(OP, buf.bytes(), src, dst, bytes)?;
        let base = self.addr(OP, "buffer", buf)?;
        self.memcpy(base + dst as u64, base + src as u64, bytes)
    }

    /// A copy is not a kernel a recorded graph replays: what was recorded runs first, so
    /// the copy sees what those kernels wrote, and inputs quantized before are stale after.
    pub(super) fn before_copy(&self) -> Result<()> {
        self.wrote();
        self.device.flush_recorded()
    }

    /// Queues `bytes` from device address `src` to `dst`; the caller checked both ranges.
    fn memcpy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: both ranges lie inside live buffers of this backend, without overlap
        // (checked by the callers).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.device.stream.cu_stream()) }
            .map_err(|e| driver_err(&format!("copying {bytes} bytes on the device"), e))
    }
}
