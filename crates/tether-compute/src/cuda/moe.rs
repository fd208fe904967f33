//! Mixture-of-experts on the GPU (kernels/moe.cu): routing into device buffers, then two
//! launches over the chosen experts' rows, reading the ids where the router wrote them.

use cudarc::driver::LaunchConfig;

use super::check::{row_bytes, shape_err, unsupported, weight_type_supported};
use super::kernel_files::{define, source};
use super::launch::{Arg, int};
use super::packed::kernel_type_id;
use super::{CudaBackend, CudaBuffer};
use crate::backend::Result;
use crate::moe::{ExpertBytes, MoeFfn, MoeRouting, MoeScratch, check_route};

/// Rows per block of `moe_gate_up` and `moe_down` (`MOE_WARPS` in moe.cu).
const MOE_WARPS: usize = define(source::MOE, "MOE_WARPS");
/// What the expert products' errors name.
const OP: &str = "moe_ffn";
/// The largest grid y dimension CUDA allows (x allows 2^31 - 1; launches keep both below).
pub(super) const MAX_GRID_Y: usize = 65_535;

/// `items` (picks or tokens) along x, fastest, and the rows in blocks of [`MOE_WARPS`]
/// along y (see moe.cu).
fn grid(op: &'static str, rows: usize, items: usize) -> Result<LaunchConfig> {
    let row_blocks = rows.div_ceil(MOE_WARPS);
    if row_blocks > MAX_GRID_Y {
        return Err(shape_err(
            op,
            format!("{rows} rows are too many for one launch"),
        ));
    }
    if items == 0 || items > MAX_GRID_Y {
        return Err(shape_err(
            op,
            format!("{items} token rows: one launch takes 1 to {MAX_GRID_Y}"),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (items as u32, row_blocks.max(1) as u32, 1),
        block_dim: (32 * MOE_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl CudaBackend {
    pub(super) fn moe_route_on_device(
        &self,
        logits: &CudaBuffer,
        n_tokens: usize,
        routing: MoeRouting,
        ids: &mut CudaBuffer,
        weights: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "moe_route";
        check_route(OP, logits, n_tokens, routing, ids, weights)?;
        let args = [
            Arg::Ptr(self.addr(OP, "router logits", logits)?),
            int(OP, "expert count", routing.n_expert)?,
            int(OP, "experts used", routing.n_used)?,
            Arg::I32(i32::from(routing.norm_weights)),
            int(OP, "token count", n_tokens)?,
            Arg::Ptr(self.addr(OP, "expert ids", ids)?),
            Arg::Ptr(self.addr(OP, "expert weights", weights)?),
        ];
        if n_tokens == 0 {
            return Ok(());
        }
        let blocks = u32::try_from(n_tokens)
            .map_err(|_| shape_err(OP, format!("{n_tokens} tokens in one launch")))?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        self.run("moe_route", cfg, &args)
    }

    pub(super) fn moe_ffn_on_device(
        &self,
        ffn: MoeFfn<'_, CudaBuffer>,
        acc: &mut CudaBuffer,
        mut scratch: MoeScratch<'_, CudaBuffer>,
    ) -> Result<()> {
        let one = ffn.check(OP, acc)?;
        scratch.check(OP, &ffn)?;
        for ty in [ffn.gate.ty, ffn.up.ty, ffn.down.ty] {
            if !weight_type_supported(ty) {
                return Err(unsupported(OP, ty));
            }
        }
        let (e, ff, n) = (ffn.n_embd, ffn.n_ff, ffn.n_tokens);
        // Each lane decodes 8 values at a time (moe.cu).
        if !e.is_multiple_of(8) || !ff.is_multiple_of(8) {
            return Err(shape_err(
                OP,
                format!("experts of {ff}x{e}: both widths must be multiples of 8"),
            ));
        }
        if n == 0 || e == 0 || ff == 0 {
            return Ok(());
        }
        if self.moe_ffn_tiles(&ffn, one, acc, &mut scratch)?
            || self.moe_ffn_int8(&ffn, one, acc, &mut scratch)?
        {
            return Ok(());
        }
        // The activations go to the gate scratch; rows and up are not needed here.
        let act = self.addr(OP, "gate scratch", scratch.gate)?;
        let acc = self.addr(OP, "accumulator", acc)?;
        // Batches past the launch limit go in slices of whole tokens.
        let step = (MAX_GRID_Y / ffn.routing.n_used).max(1);
        for t0 in (0..n).step_by(step) {
            let nt = step.min(n - t0);
            self.moe_gate_up_f32(&ffn, one, act, t0, nt)?;
            self.moe_down_f32(&ffn, one, act, acc, t0, nt)?;
        }
        Ok(())
    }

    /// `moe_gate_up` (f32 activations) over tokens `t0..t0 + nt`: their activations into
    /// `act`, `[picks][ff]` f32.
    fn moe_gate_up_f32(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        act: u64,
        t0: usize,
        nt: usize,
    ) -> Result<()> {
        let (e, ff, k) = (ffn.n_embd, ffn.n_ff, ffn.routing.n_used);
        let x = self.addr(OP, "input", ffn.x)?;
        let ids = self.addr(OP, "expert ids", ffn.ids)?;
        let args = [
            Arg::Ptr(self.addr(OP, "gate experts", ffn.gate.buf)?),
            Arg::Ptr(self.addr(OP, "up experts", ffn.up.buf)?),
            Arg::I32(kernel_type_id(ffn.gate.buf, ffn.gate.ty)),
            Arg::I32(kernel_type_id(ffn.up.buf, ffn.up.ty)),
            Arg::U64(one.gate as u64),
            Arg::U64(one.up as u64),
            Arg::U64(row_bytes(OP, ffn.gate.ty, e)? as u64),
            Arg::U64(row_bytes(OP, ffn.up.ty, e)? as u64),
            Arg::Ptr(x + (t0 * e * 4) as u64),
            Arg::Ptr(ids + (t0 * k * 4) as u64),
            int(OP, "expert count", ffn.routing.n_expert)?,
            int(OP, "embedding width", e)?,
            int(OP, "expert width", ff)?,
            int(OP, "experts used", k)?,
            Arg::Ptr(act + (t0 * k * ff * 4) as u64),
        ];
        self.run("moe_gate_up", grid(OP, ff, nt * k)?, &args)
    }

    /// `moe_down` (f32 activations) over tokens `t0..t0 + nt`: each token's experts'
    /// products of `act`, weighted, added into `acc`.
    pub(super) fn moe_down_f32(
        &self,
        ffn: &MoeFfn<'_, CudaBuffer>,
        one: ExpertBytes,
        act: u64,
        acc: u64,
        t0: usize,
        nt: usize,
    ) -> Result<()> {
        let (e, ff, k) = (ffn.n_embd, ffn.n_ff, ffn.routing.n_used);
        let ids = self.addr(OP, "expert ids", ffn.ids)?;
        let weights = self.addr(OP, "expert weights", ffn.weights)?;
        let args = [
            Arg::Ptr(self.addr(OP, "down experts", ffn.down.buf)?),
            Arg::I32(kernel_type_id(ffn.down.buf, ffn.down.ty)),
            Arg::U64(one.down as u64),
            Arg::U64(row_bytes(OP, ffn.down.ty, ff)? as u64),
            Arg::Ptr(act + (t0 * k * ff * 4) as u64),
            Arg::Ptr(ids + (t0 * k * 4) as u64),
            Arg::Ptr(weights + (t0 * k * 4) as u64),
            int(OP, "expert count", ffn.routing.n_expert)?,
            int(OP, "embedding width", e)?,
            int(OP, "expert width", ff)?,
            int(OP, "experts used", k)?,
            Arg::Ptr(acc + (t0 * e * 4) as u64),
        ];
        self.run("moe_down", grid(OP, e, nt)?, &args)
    }
}
