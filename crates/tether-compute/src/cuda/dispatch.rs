//! Launching kernels and choosing the product kernel for a matmul: what every op of the
//! cuda [`crate::Backend`] goes through.

use cudarc::driver::LaunchConfig;

use super::check::{elems, f32s, need, row_bytes, unsupported, weight_type_supported};
use super::gemm::{
    GEMM_DECODING_MIN_TOKENS, GEMM_DECODING_MIN_TOKENS_MMA, GEMM_MIN_TOKENS, GEMM_MIN_TOKENS_MMA,
};
use super::graph::Cmd;
use super::launch::Arg;
use super::matvec::{MV_MAX_TOKENS, MatmulArgs};
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result, Weight};

impl CudaBackend {
    /// Launches kernel `name`. Every op that may write device memory goes through here (or
    /// calls [`CudaBackend::wrote`]), which retires the quantized copy of a matmul input.
    pub(super) fn run(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        self.wrote();
        self.launch_kernel(name, cfg, args)
    }

    /// Launches (or records, see graph.rs) kernel `name` without retiring quantized inputs.
    pub(super) fn launch_kernel(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let kernel = self.kernels.get(name)?;
        self.device.submit(Cmd::Launch {
            name: name.to_string(),
            func: kernel.function.clone(),
            dependent: kernel.dependent_launch && self.dependent_launches,
            cfg,
            args: args.to_vec(),
        })
    }

    /// Checks a matmul's type and buffer sizes; returns the weight, input and output
    /// addresses.
    pub(super) fn matmul_operands(
        &self,
        w: Weight<'_, CudaBuffer>,
        x: &CudaBuffer,
        n_tokens: usize,
        out: &CudaBuffer,
    ) -> Result<(u64, u64, u64)> {
        const OP: &str = "matmul";
        let (w, ty, rows, cols) = (w.buf, w.ty, w.rows, w.cols);
        if !weight_type_supported(ty) {
            return Err(unsupported(OP, ty));
        }
        let rb = row_bytes(OP, ty, cols)?;
        need(OP, "weight buffer", w.bytes(), rb.checked_mul(rows))?;
        f32s(OP, "input", x, elems(OP, &[n_tokens, cols])?)?;
        f32s(OP, "output", out, elems(OP, &[n_tokens, rows])?)?;
        let (wp, xp) = (self.addr(OP, "weight", w)?, self.addr(OP, "input", x)?);
        Ok((wp, xp, self.addr(OP, "output", out)?))
    }

    /// `out = w·x`, or `out += w·x` with `accumulate`, for operands `matmul_operands`
    /// checked: the GEMM for prefill-sized batches, the matvec kernels for decode-sized, the
    /// 8-bit tensor-core products of mmq.rs between the two where they read the type.
    pub(super) fn product(
        &self,
        w: Weight<'_, CudaBuffer>,
        operands: (u64, u64, u64),
        n_tokens: usize,
        accumulate: bool,
    ) -> Result<()> {
        let a = MatmulArgs::of(w, operands, n_tokens, accumulate);
        if self.takes_decoding_gemm(&a) {
            return self.gemm(&a);
        }
        if let Some(kernel) = super::mmq::mmq_kernel(&a, self.mmq_max_tokens) {
            return self.mmq(&a, kernel);
        }
        let on_mma = self.has_mma_matvec(&a);
        let from = |measured| self.gemm_min_tokens.unwrap_or(measured);
        let gemm_from = from(if on_mma {
            GEMM_MIN_TOKENS_MMA
        } else {
            GEMM_MIN_TOKENS
        });
        if n_tokens >= gemm_from {
            return self.gemm(&a);
        }
        self.matvec(a)
    }

    /// Whether the tensor-core matvecs take `a`'s weight: only packed Q4_0 / Q8_0 have
    /// tensor-core products below the GEMM's size.
    fn has_mma_matvec(&self, a: &MatmulArgs) -> bool {
        a.packed
            && super::packed::packed_stem(a.ty).is_some()
            && self.mma_min_tokens <= MV_MAX_TOKENS
    }

    /// Whether [`Self::product`] gives `a` to the GEMM that decodes the weight in its
    /// tiles: it beats the products from the blocks and the tensor-core matvecs from 9
    /// tokens (16 against the latter; gemm.rs has the figures).
    pub(super) fn takes_decoding_gemm(&self, a: &MatmulArgs) -> bool {
        let from = self.gemm_min_tokens.unwrap_or(if self.has_mma_matvec(a) {
            GEMM_DECODING_MIN_TOKENS_MMA
        } else {
            GEMM_DECODING_MIN_TOKENS
        });
        a.n_tokens >= from && self.gemm_decodes(a)
    }

    pub(super) fn zero(&self, ptr: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.wrote();
        self.device.submit(Cmd::Zero { dst: ptr, bytes })
    }
}
