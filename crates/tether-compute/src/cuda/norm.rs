//! RMS norm on the GPU, with the 8-bit copy of decode rows the product kernels read made in
//! the same pass when the row fits in registers.

use cudarc::driver::LaunchConfig;

use super::check::{elems, f32s, shape_err};
use super::launch::{Arg, int};
use super::{CudaBackend, CudaBuffer};
use crate::backend::Result;

/// Longest row `rms_norm_q8` holds in registers (1024 threads of 16 values).
const RMS_NORM_Q8_MAX_DIM: usize = 16 * 1024;

impl CudaBackend {
    /// [`crate::Backend::rms_norm`].
    pub(super) fn rms_norm_rows(
        &self,
        x: &CudaBuffer,
        weight: &CudaBuffer,
        n_tokens: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let n = elems(OP, &[n_tokens, dim])?;
        f32s(OP, "input", x, n)?;
        f32s(OP, "weight", weight, dim)?;
        f32s(OP, "output", out, n)?;
        let (xp, wp) = (self.addr(OP, "input", x)?, self.addr(OP, "weight", weight)?);
        let op = self.addr(OP, "output", out)?;
        if n == 0 {
            return Ok(());
        }
        let blocks = u32::try_from(n_tokens)
            .map_err(|_| shape_err(OP, format!("{n_tokens} tokens are too many")))?;
        // One thread per 4 elements of a row (at most 1024), whole warps.
        let threads = dim.div_ceil(4).next_multiple_of(32).clamp(32, 1024) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(xp),
            Arg::Ptr(wp),
            int(OP, "dim", dim)?,
            Arg::F32(eps),
            Arg::Ptr(op),
        ];
        // Decode rows are also quantized for the product kernels as they are normalized,
        // by a kernel that holds a row in registers: two float4s per thread up to 1024
        // threads, at most 16 values per thread in all (elementwise.cu).
        let q8_cfg = LaunchConfig {
            block_dim: (
                dim.div_ceil(8).next_multiple_of(32).clamp(32, 1024) as u32,
                1,
                1,
            ),
            ..cfg
        };
        let fused = dim <= RMS_NORM_Q8_MAX_DIM
            && self.writing_xq(op, dim, n_tokens, |q, ds| {
                let mut with_q = args.to_vec();
                with_q.extend([Arg::Ptr(q), Arg::Ptr(ds)]);
                self.run("rms_norm_q8", q8_cfg, &with_q)
            })?;
        if fused {
            return Ok(());
        }
        self.run("rms_norm", cfg, &args)
    }
}
