//! Kernel launches with typed scalar arguments.

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use crate::backend::Result;
use crate::cuda::device::driver_err;
use crate::error::ComputeError;

/// One kernel argument, as the kernel declares it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Arg {
    /// A device pointer (or 0 for a null pointer).
    Ptr(u64),
    /// An `int`.
    I32(i32),
    /// An `unsigned long long`.
    U64(u64),
    /// A `float`.
    F32(f32),
}

/// `value` as a kernel `int`, or a shape error naming `what` when it does not fit.
pub(crate) fn int(op: &'static str, what: &str, value: usize) -> Result<Arg> {
    i32::try_from(value)
        .map(Arg::I32)
        .map_err(|_| ComputeError::Shape {
            op,
            detail: format!("{what} {value} exceeds the kernels' 32-bit index range"),
        })
}

/// A 1-D launch of `threads`-thread blocks covering `n` items with a grid-stride kernel.
pub(crate) fn grid_for(n: usize, threads: u32) -> LaunchConfig {
    // Grid-stride kernels need no more blocks than the GPU can hold at once.
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `f` on `stream` with `args` (in the kernel's parameter order); as a
/// programmatic dependent launch when `dependent` (the kernel must begin with
/// `PDL_ENTRY`, see common.cuh).
pub(crate) fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
    dependent: bool,
) -> Result<()> {
    if dependent {
        return launch_dependent(stream, f, name, cfg, args);
    }
    let mut b = stream.launch_builder(f);
    // The builder keeps pointers to the values: they live in `args` until the launch.
    for a in args {
        match a {
            Arg::Ptr(v) | Arg::U64(v) => b.arg(v),
            Arg::I32(v) => b.arg(v),
            Arg::F32(v) => b.arg(v),
        };
    }
    // SAFETY: the argument list matches the kernel's declared parameters (one wrapper per
    // kernel builds it), and every pointer is a live buffer of this backend whose size the
    // caller checked.
    unsafe { b.launch(cfg) }
        .map(|_| ())
        .map_err(|e| driver_err(&format!("launching kernel {name}"), e))
}

/// [`launch`] through `cuLaunchKernelEx` with programmatic stream serialization: the
/// kernel's blocks may start before the previous kernel on the stream has finished, and
/// wait for it (`griddepcontrol.wait`) before they touch its results. Recorded into a CUDA
/// graph, the attribute becomes a programmatic edge.
fn launch_dependent(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    use cudarc::driver::sys;
    use std::ffi::c_void;

    // Each value in an 8-byte slot: the driver reads as many bytes as the parameter has
    // from the start of its slot (little-endian, so an int is the slot's low bytes).
    let mut slots: Vec<u64> = args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(v) | Arg::U64(v) => v,
            Arg::I32(v) => u64::from(v as u32),
            Arg::F32(v) => u64::from(v.to_bits()),
        })
        .collect();
    let mut params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|s| (s as *mut u64).cast::<c_void>())
        .collect();
    // SAFETY: an all-zero attribute value is valid (a plain C union of integers).
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| driver_err(&format!("binding the context to launch {name}"), e))?;
    // SAFETY: `params` points at one slot per kernel parameter, in order, all alive until
    // the call returns (the driver copies them); the pointers among them are live buffers
    // whose sizes the op checked; `attr` and `config` outlive the call.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| driver_err(&format!("launching kernel {name}"), e))
}
