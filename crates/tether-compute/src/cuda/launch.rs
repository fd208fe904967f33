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

/// Launches `f` on `stream` with `args` (in the kernel's parameter order).
pub(crate) fn launch(
    stream: &CudaStream,
    f: &CudaFunction,
    name: &str,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
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
