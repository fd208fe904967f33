//! The CUDA backend: device memory owned by [`CudaBuffer`] values, kernels written in CUDA C
//! (`kernels/*.cu` at the repository root) and compiled by NVRTC at backend creation.
//!
//! The CUDA libraries are loaded at run time, so building needs no CUDA toolkit, and a
//! machine without a driver gets an error from [`CudaBackend::new`], never a panic. Every
//! op and copy runs on one stream per backend, which orders them without events; a buffer's
//! `Drop` synchronizes that stream before freeing.

mod argmax;
mod attention;
mod attention_flash;
mod attention_tiled;
mod check;
mod compile;
mod copy;
mod device;
mod dispatch;
mod gated;
mod gemm;
mod gemm_grouped;
mod graph;
mod kernel_files;
mod launch;
mod matvec;
mod mmq;
mod moe;
mod moe_gemm;
mod moe_int8;
mod norm;
mod nvml;
mod ops;
mod packed;
mod ptx_cache;
mod rope;
mod shared;
mod staging;
mod tuning;
mod upload;

pub use device::CudaBuffer;
pub use gemm::GEMM_MIN_TOKENS;
pub use graph::CudaReplays;
pub use tuning::CudaTuning;
pub use upload::CudaUploads;

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUdevice_attribute;

use crate::backend::{DeviceBuffer, Result};
use crate::error::ComputeError;
use compile::Kernels;
use device::{Device, driver_err};
use gemm::GemmWorkspace;
use staging::Staging;

/// A backend on one CUDA device.
pub struct CudaBackend {
    device: Arc<Device>,
    kernels: Kernels,
    /// Index staging; held for the whole of an op, from staging to launch, so no other
    /// thread can recycle the slot in between.
    staging: Mutex<Staging>,
    /// Where small downloads land (staging.rs); never locked with `staging`.
    bounce: Mutex<staging::Bounce>,
    /// Partial results of split attention, of a fixed size (attention.rs); locked after
    /// `staging`.
    scratch: Mutex<CudaBuffer>,
    /// Decode activations quantized to 8-bit blocks (see `matvec.rs`); fixed size.
    xq: Mutex<matvec::Xq>,
    /// Bumped by every op that may write device memory (see `matvec.rs`).
    write_epoch: AtomicU64,
    /// Held while a thread records a decode step (graph.rs).
    step: Mutex<()>,
    /// The side stream decode steps are captured on (capturing issues nothing).
    capture: Arc<cudarc::driver::CudaStream>,
    /// Multiprocessors of the device: decode attention splits its cells to fill them.
    sm_count: usize,
    /// The head sizes prefill attention takes the tensor-core flash kernel for.
    flash: attention_flash::FlashKernels,
    /// Whether kernels that allow it are launched as programmatic dependent launches
    /// (compute capability 9.0 and later, unless tuned off): each kernel's blocks start
    /// while the previous one finishes, which hides a launch's latency and lets the decode
    /// products fetch their weights early.
    dependent_launches: bool,
    /// Tokens from which every product takes the GEMM, instead of the measured boundaries
    /// of gemm.rs (`GEMM_MIN_TOKENS*`, `GEMM_DECODING_MIN_TOKENS*`; see
    /// [`CudaTuning::gemm_min_tokens`]).
    gemm_min_tokens: Option<usize>,
    /// Products of packed weights over at least this many tokens take the int8 tensor
    /// cores (`usize::MAX` before compute capability 8.0; [`CudaTuning::mma_min_tokens`]
    /// overrides it).
    mma_min_tokens: usize,
    /// Batches of 9-32 (by weight type) to this many tokens over the weight types mmq.rs
    /// reads take its int8 tensor-core kernels ([`CudaTuning::mmq_max_tokens`] or mmq.rs's
    /// default; always 0 before compute capability 8.0, `mmq_capable` false).
    mmq_max_tokens: usize,
    mmq_capable: bool,
    /// Blocks per multiprocessor the 8-bit products split K to fill
    /// ([`CudaTuning::mmq_blocks_per_sm`] or mmq.rs's measured default).
    mmq_blocks_per_sm: usize,
    /// Whether the GEMM decodes the weight types it reads in its tiles
    /// ([`CudaTuning::fused_gemm`]).
    fused_gemm: bool,
    /// Tokens from which MoE prefill takes the tile kernels (moe_gemm.rs;
    /// [`CudaTuning::moe_tile_min_tokens`]).
    moe_tile_min_tokens: usize,
    /// f16 operands of the prefill GEMM, allocated once here so no op allocates.
    gemm_ws: Mutex<GemmWorkspace>,
    /// Per-process memory of this device, when NVML is there to ask.
    nvml: Option<nvml::Nvml>,
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the shared library; nothing is called through it.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// How many CUDA devices this machine has: 0 without a driver or when it cannot tell.
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count()
        .ok()
        .and_then(|n| usize::try_from(n).ok())
        .unwrap_or(0)
}

impl CudaBackend {
    /// [`CudaBackend::with_tuning`] with the measured defaults ([`CudaTuning::default`]:
    /// no kernel cache on disk). The backend never reads the environment itself: binaries
    /// and GPU tests read it once, with [`CudaTuning::from_env`], and pass the result in.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_tuning(ordinal, &CudaTuning::default())
    }

    /// Opens device `ordinal`, compiles (or loads from the disk cache) the kernels and
    /// allocates the index staging memory, with `tuning`'s knobs. Fails with
    /// [`ComputeError::Unavailable`] when there is no CUDA driver, no such device, or no
    /// NVRTC.
    pub fn with_tuning(ordinal: usize, tuning: &CudaTuning) -> Result<Self> {
        // cudarc panics on the first call into a missing library; ask before calling.
        if !driver_present() {
            return Err(ComputeError::Unavailable(
                "the CUDA driver library (libcuda.so) was not found on this machine: install \
                 the NVIDIA driver, or use the cpu backend"
                    .to_string(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            ComputeError::Unavailable(format!(
                "opening CUDA device {ordinal} failed (driver error {:?}); check that the \
                 device exists (nvidia-smi) and is visible (CUDA_VISIBLE_DEVICES)",
                e.0
            ))
        })?;
        let gpu = ctx
            .name()
            .map_err(|e| driver_err(&format!("reading the name of CUDA device {ordinal}"), e))?;
        let cc = ctx.compute_capability().map_err(|e| {
            driver_err(
                &format!("reading the compute capability of CUDA device {ordinal}"),
                e,
            )
        })?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_err(&format!("creating a stream on CUDA device {ordinal}"), e))?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| {
                driver_err(&format!("reading the SM count of CUDA device {ordinal}"), e)
            })?;
        let kernels = Kernels::load(
            &ctx,
            cc,
            tuning.kernel_cache.as_deref(),
            tuning.kernel_sources.as_deref(),
        )?;
        let flash = if tuning.flash_attention {
            attention_flash::FlashKernels::enable(&ctx, cc, &kernels)?
        } else {
            attention_flash::FlashKernels::default()
        };
        let capture = ctx.new_stream().map_err(|e| {
            driver_err(
                &format!("creating a capture stream on CUDA device {ordinal}"),
                e,
            )
        })?;
        let nvml = nvml::pci_bus_id(ctx.cu_device()).and_then(|bus| nvml::Nvml::open(&bus));
        let device = Arc::new(Device::new(ctx, stream, format!("cuda:{ordinal} {gpu}")));
        let dependent_launches = cc.0 >= 9 && tuning.dependent_launches;
        let mma_min_tokens = if cc.0 >= 8 {
            tuning.mma_min_tokens.unwrap_or(matvec::MMA_MIN_TOKENS)
        } else {
            usize::MAX
        };
        let mmq_max_tokens = mmq::mmq_max_tokens(cc, tuning.mmq_max_tokens);
        let copy_in = kernels
            .get("copy_in")
            .ok()
            .map(|k| (k.function.clone(), k.dependent_launch && dependent_launches));
        let staging = Mutex::new(Staging::new(&device, staging::Copier::new(copy_in))?);
        let xq = Mutex::new(matvec::Xq::new(device.alloc(matvec::XQ_BYTES)?));
        let gemm_ws = Mutex::new(GemmWorkspace::new(&device)?);
        let scratch = Mutex::new(device.alloc(attention::SCRATCH_BYTES)?);
        Ok(Self {
            device,
            kernels,
            staging,
            bounce: Mutex::default(),
            scratch,
            xq,
            capture,
            step: Mutex::new(()),
            write_epoch: AtomicU64::new(0),
            sm_count: usize::try_from(sm_count).unwrap_or(1).max(1),
            flash,
            dependent_launches,
            gemm_min_tokens: tuning.gemm_min_tokens,
            mma_min_tokens,
            mmq_max_tokens,
            mmq_capable: cc.0 >= 8,
            mmq_blocks_per_sm: tuning.mmq_blocks_per_sm.unwrap_or(mmq::MMQ_BLOCKS_PER_SM),
            fused_gemm: tuning.fused_gemm,
            moe_tile_min_tokens: tuning
                .moe_tile_min_tokens
                .unwrap_or(moe_gemm::MOE_TILE_MIN_TOKENS),
            gemm_ws,
            nvml,
        })
    }

    /// Device bytes this process holds on the backend's device as NVML reports them (every
    /// context, allocation and library workspace of the process there), or `None` without
    /// NVML or when it does not list this process.
    pub(crate) fn process_used(&self) -> Option<u64> {
        self.nvml.as_ref()?.process_used(std::process::id())
    }

    /// Head sizes whose prefill attention runs on the tensor-core flash kernel on this
    /// device (none before compute capability 8.0 or when tuned off).
    pub fn flash_attention_head_dims(&self) -> &[usize] {
        self.flash.head_dims()
    }

    /// Bytes of device memory currently allocated through this backend (buffers, staging).
    pub fn allocated_bytes(&self) -> u64 {
        self.device.allocated_bytes()
    }

    /// Bytes of device memory the backend holds for itself (index staging, quantized
    /// decode activations, GEMM workspace, attention scratch).
    pub fn internal_bytes(&self) -> usize {
        let staging = self.lock_staging().device_bytes();
        staging + self.lock_xq().bytes() + self.lock_gemm().bytes() + self.lock_scratch().bytes()
    }

    /// [`crate::Backend::replay`]: the staging ring restarts (so the step's index arrays
    /// land where they did last time), then the step is recorded and issued (graph.rs).
    pub(crate) fn replay_step<R>(
        &self,
        replays: &mut CudaReplays,
        key: u64,
        f: impl FnOnce() -> R,
    ) -> Result<R> {
        if graph::in_step() {
            return Ok(f());
        }
        // One step at a time records (the step staging area is shared); others wait.
        let _step = self.step.lock().unwrap_or_else(|p| p.into_inner());
        self.lock_staging().rewind_step()?;
        self.lock_xq().restart();
        graph::replay(&self.device, &self.capture, replays, key, f)
    }

    fn lock_scratch(&self) -> MutexGuard<'_, CudaBuffer> {
        // The scratch holds no state between ops, so a poisoned lock is still usable.
        self.scratch.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_staging(&self) -> MutexGuard<'_, Staging> {
        // A panic while staging leaves the ring consistent (offsets only grow), so a
        // poisoned lock is still usable.
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The device address of `buf`, after checking it was allocated by this backend.
    fn addr(&self, op: &'static str, what: &str, buf: &CudaBuffer) -> Result<u64> {
        if !buf.belongs_to(&self.device) {
            return Err(check::shape_err(
                op,
                format!(
                    "{what} ({} bytes) was allocated by another CUDA backend",
                    buf.bytes()
                ),
            ));
        }
        Ok(buf.ptr())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_reports_an_error_instead_of_panicking_without_a_gpu() {
        let result = std::panic::catch_unwind(|| CudaBackend::new(0));
        let result = result.expect("CudaBackend::new must not panic");
        if !driver_present() {
            match result {
                Err(ComputeError::Unavailable(msg)) => assert!(msg.contains("libcuda"), "{msg}"),
                Err(e) => panic!("expected Unavailable, got {e}"),
                Ok(_) => panic!("a backend without a CUDA driver"),
            }
        }
    }

    #[test]
    fn device_count_is_zero_without_a_driver() {
        if !driver_present() {
            assert_eq!(device_count(), 0);
        }
    }

    #[test]
    fn a_device_that_does_not_exist_is_an_error() {
        match CudaBackend::new(4096) {
            Err(ComputeError::Unavailable(msg)) => assert!(!msg.is_empty()),
            Err(e) => panic!("expected Unavailable, got {e}"),
            Ok(_) => panic!("device 4096 should not exist"),
        }
    }
}
