//! Rotary embedding on the GPU: the plain kernel, and the decode step's fused rotation and
//! f16 cache write; both apply llama3 factors, linear scaling and YaRN
//! ([`crate::rope`]).

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::check::{elems, f32s, shape_err};
use super::launch::{Arg, grid_for, int};
use super::{CudaBackend, CudaBuffer};
use crate::backend::{AttnShape, Backend, DeviceBuffer, KvCacheMut, Qkv, Result, Rope};
use crate::rope::{YarnRamp, yarn_ramp};
use crate::shape_check::rope_args;

/// Threads per block of the plain rope kernel.
const THREADS: u32 = 256;

/// The most tokens `rope_store_f16` takes in one launch: decode steps of up to 64
/// sequences. Four launches instead of one cost 0.3 ms of a 16-sequence llama3-8b step on
/// an H100 (rope 303 us and kv_store 165 us for 64 launches each, ncu); prefill batches
/// keep them, as measured when the fused kernel came.
const ROPE_STORE_MAX_TOKENS: usize = 64;

impl CudaBackend {
    /// [`Backend::rope`] of `x`, `(n_tokens, n_heads, head_dim)` rows of heads.
    pub(super) fn rope_on_device(
        &self,
        x: &mut CudaBuffer,
        (n_tokens, n_heads, head_dim): (usize, usize, usize),
        positions: &[u32],
        Rope {
            params,
            freq_factors,
        }: Rope<'_, CudaBuffer>,
    ) -> Result<()> {
        const OP: &str = "rope";
        rope_args(OP, n_tokens, head_dim, positions, params)?;
        f32s(OP, "input", x, elems(OP, &[n_tokens, n_heads, head_dim])?)?;
        let factors = match freq_factors {
            Some(f) => {
                f32s(OP, "freq_factors", f, params.n_rot / 2)?;
                self.addr(OP, "freq_factors", f)?
            }
            None => 0,
        };
        let xp = self.addr(OP, "input", x)?;
        let pairs = elems(OP, &[n_tokens, n_heads, params.n_rot / 2])?;
        if pairs == 0 {
            return Ok(());
        }
        let (yarn_low, yarn_high, mscale) = YarnRamp::kernel_args(yarn_ramp(params));
        let mut staging = self.lock_staging();
        let pos_at = staging.stage_u32(&positions[..n_tokens])?;
        let args = [
            Arg::Ptr(xp),
            int(OP, "n_tokens", n_tokens)?,
            int(OP, "n_heads", n_heads)?,
            int(OP, "head_dim", head_dim)?,
            Arg::Ptr(pos_at),
            int(OP, "n_rot", params.n_rot)?,
            Arg::F32(params.freq_base),
            Arg::F32(params.freq_scale),
            Arg::I32(i32::from(params.neox)),
            Arg::Ptr(factors),
            Arg::F32(yarn_low),
            Arg::F32(yarn_high),
            Arg::F32(mscale),
        ];
        self.run("rope", grid_for(pairs, THREADS), &args)
    }

    /// [`Backend::rope_and_store`]: one fused launch for decode steps into an f16 cache.
    pub(super) fn rope_and_store_on_device(
        &self,
        Qkv { q, k, v }: Qkv<'_, CudaBuffer>,
        shape: AttnShape,
        positions: &[u32],
        rope: Rope<'_, CudaBuffer>,
        cells: &[u32],
        cache: KvCacheMut<'_, CudaBuffer>,
    ) -> Result<()> {
        const OP: &str = "rope_and_store";
        let (n, hd) = (positions.len(), shape.head_dim);
        let kv_dim = shape.n_kv_heads * hd;
        let KvCacheMut {
            k: k_cache,
            v: v_cache,
            ty: cache_ty,
        } = cache;
        // Quantized caches and prefill batches take the four ops apart.
        if cache_ty != GgmlType::F16 || n > ROPE_STORE_MAX_TOKENS || n != cells.len() || n == 0 {
            self.rope(q, n, shape.n_heads, hd, positions, rope)?;
            self.rope(k, n, shape.n_kv_heads, hd, positions, rope)?;
            self.kv_store(k, kv_dim, cells, k_cache, cache_ty)?;
            return self.kv_store(v, kv_dim, cells, v_cache, cache_ty);
        }
        let Rope {
            params,
            freq_factors,
        } = rope;
        rope_args(OP, n, hd, positions, params)?;
        f32s(OP, "queries", q, elems(OP, &[n, shape.n_heads, hd])?)?;
        f32s(OP, "keys", k, elems(OP, &[n, kv_dim])?)?;
        f32s(OP, "values", v, elems(OP, &[n, kv_dim])?)?;
        let row = elems(OP, &[kv_dim, 2])?;
        for (cache, what) in [(&*k_cache, "key cache"), (&*v_cache, "value cache")] {
            let n_cells = cache.bytes().checked_div(row).unwrap_or(0);
            if let Some(&bad) = cells.iter().find(|&&c| c as usize >= n_cells) {
                return Err(shape_err(
                    OP,
                    format!("cell {bad} is outside the {what} of {n_cells} cells"),
                ));
            }
        }
        let factors = match freq_factors {
            Some(f) => {
                f32s(OP, "freq_factors", f, params.n_rot / 2)?;
                self.addr(OP, "freq_factors", f)?
            }
            None => 0,
        };
        let (qp, kp, vp) = (
            self.addr(OP, "queries", q)?,
            self.addr(OP, "keys", k)?,
            self.addr(OP, "values", v)?,
        );
        let (kc, vc) = (
            self.addr(OP, "key cache", k_cache)?,
            self.addr(OP, "value cache", v_cache)?,
        );
        let heads = u32::try_from(shape.n_heads + shape.n_kv_heads)
            .map_err(|_| shape_err(OP, "too many heads".to_string()))?;
        let (yarn_low, yarn_high, mscale) = YarnRamp::kernel_args(yarn_ramp(params));
        let mut staging = self.lock_staging();
        let pos_at = staging.stage_u32(positions)?;
        let cells_at = staging.stage_u32(cells)?;
        let cfg = LaunchConfig {
            grid_dim: (heads, n as u32, 1),
            block_dim: (64, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(qp),
            Arg::Ptr(kp),
            Arg::Ptr(vp),
            int(OP, "n_heads", shape.n_heads)?,
            int(OP, "n_kv_heads", shape.n_kv_heads)?,
            int(OP, "head_dim", hd)?,
            Arg::Ptr(pos_at),
            int(OP, "n_rot", params.n_rot)?,
            Arg::F32(params.freq_base),
            Arg::F32(params.freq_scale),
            Arg::I32(i32::from(params.neox)),
            Arg::Ptr(factors),
            Arg::F32(yarn_low),
            Arg::F32(yarn_high),
            Arg::F32(mscale),
            Arg::Ptr(cells_at),
            Arg::Ptr(kc),
            Arg::Ptr(vc),
        ];
        self.run("rope_store_f16", cfg, &args)
    }
}
