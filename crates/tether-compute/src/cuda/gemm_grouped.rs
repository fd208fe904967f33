//! Products of one input with two or three weights in one launch of the GEMM's narrow tile
//! kernels: attention's q/k/v, and a feed-forward's gate/up with the activation applied as
//! the partial sums are added. At decode batches of 9-64 tokens a product's own launch,
//! token conversion and split-K sum cost about a third of its tiles' time (ncu, H100,
//! llama3-8b Q4_0, 16 sequences: 7 tile launches a layer at 23 us each, beside 7
//! conversions at 2.7 us, 7 sums at 3.4 us and the SiLU pass), so q/k/v and gate/up each
//! take one of each.

use cudarc::driver::LaunchConfig;

use super::check::row_bytes;
use super::gated::kernel_code;
use super::gemm::{
    MAX_GRID_Y, PARTIAL_ELEMS, THREADS, TILE_K, TILE_M, X16_ELEMS, decoding, decoding_kernel,
    padded_cols, split_k,
};
use super::launch::{Arg, grid_for, int};
use super::matvec::MatmulArgs;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{GateAct, Result, Weight};

const OP: &str = "matmul";

/// What becomes of a grouped product's sums.
enum Grouped<'a> {
    /// Each weight's product into its own output (q, k, v).
    Apart([&'a CudaBuffer; 3]),
    /// `act(gate · x) · (up · x)` into one output (the weights are `[gate, up]`).
    Gated(GateAct, &'a CudaBuffer),
}

impl CudaBackend {
    /// q/k/v: `outs[i] = ws[i] · x` as [`Self::grouped_product`] runs them; false where it
    /// does not take them.
    pub(super) fn grouped_qkv(
        &self,
        ws: [Weight<'_, CudaBuffer>; 3],
        x: &CudaBuffer,
        n_tokens: usize,
        outs: [&CudaBuffer; 3],
    ) -> Result<bool> {
        self.grouped_product(&ws, x, n_tokens, Grouped::Apart(outs))
    }

    /// `out = act(gate · x) · (up · x)` as [`Self::grouped_product`] runs it; false where it
    /// does not take it.
    pub(super) fn grouped_gated(
        &self,
        act: GateAct,
        gate_up: [Weight<'_, CudaBuffer>; 2],
        x: &CudaBuffer,
        n_tokens: usize,
        out: &CudaBuffer,
    ) -> Result<bool> {
        self.grouped_product(&gate_up, x, n_tokens, Grouped::Gated(act, out))
    }

    /// `ws` (two or three weights of one input `x`) multiplied as `out` says, in one launch of
    /// a narrow decoding tile kernel. Returns false, having done nothing, where that launch
    /// does not take them: some product would not go to the decoding GEMM on its own
    /// (`CudaBackend::takes_decoding_gemm`), the weights differ in type, layout or columns,
    /// a boundary between them is not a whole row tile, or the sums do not fit the
    /// workspace's partials.
    fn grouped_product(
        &self,
        ws: &[Weight<'_, CudaBuffer>],
        x: &CudaBuffer,
        n_tokens: usize,
        out: Grouped<'_>,
    ) -> Result<bool> {
        let mut parts = Vec::with_capacity(ws.len());
        for (i, &w) in ws.iter().enumerate() {
            let dst = match &out {
                Grouped::Apart(outs) => outs.get(i).copied(),
                Grouped::Gated(_, o) => Some(*o),
            };
            let Some(dst) = dst else {
                return Ok(false);
            };
            let operands = self.matmul_operands(w, x, n_tokens, dst)?;
            let a = MatmulArgs::of(w, operands, n_tokens, false);
            if a.rows == 0 || a.cols == 0 || n_tokens == 0 || !self.takes_decoding_gemm(&a) {
                return Ok(false);
            }
            parts.push(a);
        }
        let same = |p: &MatmulArgs| {
            let f = &parts[0];
            p.ty == f.ty && p.packed == f.packed && p.cols == f.cols
        };
        let fits = match &out {
            Grouped::Apart(_) => parts.len() == 3,
            Grouped::Gated(..) => parts.len() == 2 && parts[0].rows == parts[1].rows,
        };
        if !fits || !parts.iter().all(same) {
            return Ok(false);
        }
        self.gemm_grouped(&parts, &out)
    }

    /// The launch of [`Self::grouped_product`] for its checked `parts`.
    fn gemm_grouped(&self, parts: &[MatmulArgs], out: &Grouped<'_>) -> Result<bool> {
        let first = &parts[0];
        let Some(names) = decoding_kernel(first) else {
            return Ok(false);
        };
        let tile = decoding(names, first.n_tokens);
        // Where each weight's rows end in the product; all but the last end on a tile edge.
        let ends: Vec<usize> = parts
            .iter()
            .scan(0, |end, p| {
                *end += p.rows;
                Some(*end)
            })
            .collect();
        let (m, nt) = (ends[ends.len() - 1], first.n_tokens);
        let kp = padded_cols(first.cols)?;
        let whole_tiles = ends[..ends.len() - 1]
            .iter()
            .all(|e| e.is_multiple_of(TILE_M));
        let room = nt.checked_mul(m).is_some_and(|e| e <= PARTIAL_ELEMS)
            && nt.checked_mul(kp).is_some_and(|e| e <= X16_ELEMS);
        if !tile.grouped || !whole_tiles || !room || m.div_ceil(TILE_M) > MAX_GRID_Y {
            return Ok(false);
        }
        let rb = row_bytes(OP, first.ty, first.cols)?;
        let (m_arg, nt_arg) = (int(OP, "rows", m)?, int(OP, "token count", nt)?);
        let (cols_arg, kp_arg) = (int(OP, "cols", first.cols)?, int(OP, "padded cols", kp)?);
        let e0 = int(OP, "rows", ends[0])?;
        let e1 = int(OP, "rows", ends.get(1).copied().unwrap_or(m))?;
        let w = |i: usize| Arg::Ptr(parts[i.min(parts.len() - 1)].w);

        let ws = self.lock_gemm();
        let (x16, _, partials) = ws.areas();
        self.tokens_to_f16(first.x, (cols_arg, kp_arg), nt, kp, x16)?;
        let (m_tiles, n_tiles) = (m.div_ceil(TILE_M), nt.div_ceil(tile.tile_n));
        let (splits, k_tiles) = split_k(
            m_tiles * n_tiles,
            kp / TILE_K,
            nt * m,
            tile.blocks_per_sm * self.sm_count,
        );
        let stride = (nt * m) as u64;
        let cfg = LaunchConfig {
            grid_dim: (n_tiles as u32, m_tiles as u32, splits as u32),
            block_dim: (tile.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // The sums always go through the partials (one split included): the pass that
        // adds them is where they are split apart or gated.
        let args = [
            w(0),
            Arg::U64(rb as u64),
            Arg::Ptr(x16),
            m_arg,
            nt_arg,
            kp_arg,
            Arg::I32(k_tiles as i32),
            Arg::Ptr(partials),
            m_arg,
            Arg::U64(stride),
            Arg::I32(0),
            w(1),
            w(2),
            e0,
            e1,
        ];
        self.run(tile.name, cfg, &args)?;
        let splits = Arg::I32(splits as i32);
        match out {
            Grouped::Apart(_) => {
                let args = [
                    Arg::Ptr(partials),
                    splits,
                    Arg::U64(stride),
                    m_arg,
                    nt_arg,
                    e0,
                    e1,
                    Arg::Ptr(parts[0].out),
                    Arg::Ptr(parts[1].out),
                    Arg::Ptr(parts[2].out),
                ];
                self.run("gemm_reduce3", grid_for(nt * m, THREADS), &args)?;
            }
            Grouped::Gated(act, _) => {
                let args = [
                    Arg::Ptr(partials),
                    splits,
                    Arg::U64(stride),
                    e0,
                    nt_arg,
                    Arg::I32(kernel_code(*act)),
                    Arg::Ptr(first.out),
                ];
                self.run("gemm_reduce_gated", grid_for(nt * ends[0], THREADS), &args)?;
            }
        }
        Ok(true)
    }
}
