//! The one trait every compute backend implements: buffers owned by values whose `Drop`
//! frees them, and the ops a LLaMA-family layer needs.
//!
//! Activations are f32, row-major `[n_tokens][dim]`. Weights keep their GGUF type and are
//! row-major `[rows][cols]` (GGUF's `ne[0]` = cols is the contiguous dimension). Index arrays
//! (token ids, positions, KV cells, attention spans) come from the host; a device backend
//! copies them into staging memory that it owns.
//!
//! A backend never allocates inside an op: every buffer an op touches was allocated before
//! (at Prepare), so serving allocates no device memory.

use crate::error::ComputeError;
use crate::moe::{MoeFfn, MoeRouting, MoeScratch};
pub use crate::operands::{KvCache, KvCacheMut, Qkv, Rope, Scores, Weight};
use crate::operands::{common_cols, gate_up_shape};
use crate::shared::SharedArea;
use tether_gguf::GgmlType;

/// Result type of every backend call.
pub type Result<T> = std::result::Result<T, ComputeError>;

/// Total and free memory of the device, as its driver reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes the device has in all.
    pub total: u64,
    /// Bytes free right now.
    pub free: u64,
}

/// A block of device memory. Dropping it frees the memory (after the device has finished
/// every op that uses it).
pub trait DeviceBuffer: Send + Sync + 'static {
    /// Size in bytes, as allocated.
    fn bytes(&self) -> usize;
}

/// Rotary position embedding parameters (llama.cpp's conventions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Dimensions rotated per head (usually `head_dim`).
    pub n_rot: usize,
    /// `rope.freq_base` (10000 for llama2, 500000 for llama3, 1e6 for qwen2).
    pub freq_base: f32,
    /// 1 / linear scaling factor; 1.0 when the model asks for no scaling.
    pub freq_scale: f32,
    /// NEOX style rotates pairs `(i, i + n_rot/2)` (qwen2); normal style rotates `(2i, 2i+1)` (llama).
    pub neox: bool,
    /// YaRN scaling (with `freq_scale` = 1 / its factor); `None` for plain or linear rope.
    pub yarn: Option<crate::rope::YarnParams>,
}

/// The activation of a gated feed-forward (`act(gate · x) · (up · x)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateAct {
    /// `silu(x) = x / (1 + e^-x)`: LLaMA, Qwen, Phi-3.
    Silu,
    /// GELU with the tanh approximation: Gemma.
    GeluTanh,
}

/// The shape of multi-head attention with grouped KV heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads; `n_heads` is a multiple of it.
    pub n_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Cells of each sequence's ring when the cache read is a ring (sliding-window layers
    /// that keep only their window); 0: spans index cells directly. With a ring of `r`
    /// cells, span cells are virtual: sequence `s` owns virtual cells `[2·r·s, 2·r·(s+1))`
    /// and virtual cell `v` is stored in cache cell [`ring_cell`]`(v, r)`, so a window that
    /// wraps round the ring is still one span of consecutive virtual cells.
    pub ring_cells: u32,
}

/// The cache cell that holds virtual cell `v` of a ring of `ring_cells` cells per sequence
/// (see [`AttnShape::ring_cells`]); `v` itself when `ring_cells` is 0.
pub fn ring_cell(v: u32, ring_cells: u32) -> u32 {
    if ring_cells == 0 {
        return v;
    }
    let per_seq = 2 * ring_cells;
    (v / per_seq) * ring_cells + (v % per_seq) % ring_cells
}

/// Cells of one block of a paged KV cache (see [`KvCache::blocks`]); `KV_BLOCK_CELLS` in
/// the CUDA kernels.
pub const KV_BLOCK_CELLS: u32 = 32;

/// The cache cell of virtual cell `v`: in a ring of `ring_cells` cells per sequence (see
/// [`ring_cell`]), else through the block table `blocks` (see [`KvCache::blocks`]), else
/// `v` itself. A cache is a ring or paged, never both. `blocks` must cover `v`.
pub fn kv_cell(v: u32, ring_cells: u32, blocks: Option<&[u32]>) -> u32 {
    match blocks {
        _ if ring_cells != 0 => ring_cell(v, ring_cells),
        Some(table) => table[(v / KV_BLOCK_CELLS) as usize] * KV_BLOCK_CELLS + v % KV_BLOCK_CELLS,
        None => v,
    }
}

/// The KV cells one query token attends to: `n_cells` consecutive cells from `first_cell`,
/// the last of which holds the token itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnSpan {
    /// Index of the first visible cell in the cache.
    pub first_cell: u32,
    /// Number of visible cells (at least 1).
    pub n_cells: u32,
}

/// A compute device: allocation, transfers, and the ops of a LLaMA-family forward pass.
///
/// Every op checks that its buffers are large enough for the sizes it is given and returns
/// [`ComputeError::Shape`] otherwise; no op panics on bad sizes.
pub trait Backend: Send + Sync + 'static {
    /// The device buffer type of this backend.
    type Buffer: DeviceBuffer;

    /// What [`Backend::replay`] keeps between calls (captured launch sequences); owned by
    /// the caller, so it lives and dies with the stage (session) that uses it.
    type Replays: Default + Send + 'static;

    /// An allocation of another backend opened by [`Backend::open_shared`]: it stays
    /// readable here until the value is dropped.
    type Borrowed: Send + Sync + 'static;

    /// What a run of weight uploads keeps ([`Backend::begin_uploads`]); owned by the stage
    /// being loaded.
    type Uploads: Send + 'static;

    /// A human-readable device name (`cpu`, `cuda:0 NVIDIA H100 80GB HBM3`).
    fn name(&self) -> String;

    /// Total and free device memory.
    fn memory_info(&self) -> Result<MemoryInfo>;

    /// Device memory this process holds on the device, as the driver's management library
    /// counts it per process (NVML on NVIDIA GPUs), when it can tell. Unlike
    /// [`Backend::memory_info`], other processes on the same device do not move it.
    fn process_memory(&self) -> Option<u64> {
        None
    }

    /// Runs `f`, which issues many ops, in the backend's execution context. The cpu backend
    /// runs it on its compute pool, so each op starts on a pool thread instead of waking
    /// the pool from outside and blocking: for small models that hop costs more than the
    /// op.
    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Runs `f`, a step of ops (no downloads) that the caller repeats with the same sizes,
    /// such as one decode step of a model's layers. A backend may record the ops and replay
    /// the recording next time instead of issuing them one by one, when they are the same
    /// ops on the same buffers; the results are those of running `f`. Steps under
    /// different `key`s are recorded apart.
    fn replay<R>(&self, replays: &mut Self::Replays, key: u64, f: impl FnOnce() -> R) -> Result<R> {
        let _ = (replays, key);
        Ok(f())
    }

    /// Allocates one buffer per entry of `sizes`, all at once: a session's weights, caches and
    /// scratch. A backend may carve them out of one allocation (the memory returns when the
    /// last of them is dropped), so that what the device reports in use is the sum of the
    /// sizes and not each buffer rounded up to the driver's page. Fails like [`Backend::alloc`].
    fn alloc_many(&self, sizes: &[usize]) -> Result<Vec<Self::Buffer>> {
        sizes.iter().map(|&s| self.alloc(s)).collect()
    }

    /// Allocates `bytes` of device memory. Fails with [`ComputeError::OutOfMemory`], never aborts.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Called once weight `w` (rows of `row_len` values of `ty`, the whole buffer) has been
    /// written in full. The backend may rewrite its bytes in place into a layout its
    /// kernels read faster (the cuda backend packs Q4_0 and Q8_0 rows); from then on only
    /// this backend's ops read it, and it must not be written again.
    fn finish_weight(&self, w: &mut Self::Buffer, ty: GgmlType, row_len: usize) -> Result<()> {
        let _ = (w, ty, row_len);
        Ok(())
    }

    /// Copies `src` into `dst` at byte `offset`.
    fn upload(&self, dst: &mut Self::Buffer, offset: usize, src: &[u8]) -> Result<()>;

    /// Starts a run of weight uploads (one load): whatever [`Backend::upload_weight`] needs
    /// to overlap its copies (the cuda backend's pinned buffers and copy streams). The
    /// stage being loaded owns it; dropping it waits for its copies.
    fn begin_uploads(&self) -> Result<Self::Uploads>;

    /// Copies `src` into `dst` at byte `offset` as part of `uploads`. The copy may still be
    /// in flight when this returns (`src` has been read already); it is done once
    /// [`Backend::finish_uploads`] returns, and nothing may read `dst` before.
    fn upload_weight(
        &self,
        uploads: &mut Self::Uploads,
        dst: &mut Self::Buffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()>;

    /// Waits until every copy of `uploads` is done, then frees what they used.
    fn finish_uploads(&self, uploads: Self::Uploads) -> Result<()>;

    /// Copies bytes from `src` at byte `offset` into `dst`, waiting for pending work first.
    fn download(&self, src: &Self::Buffer, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Waits until every op issued so far has finished.
    fn synchronize(&self) -> Result<()>;

    /// `out[t] = dequant(table row ids[t])`: embedding lookup; `table` is `[n_rows][row_len]` of `ty`.
    fn get_rows(
        &self,
        table: &Self::Buffer,
        ty: GgmlType,
        row_len: usize,
        ids: &[u32],
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// `out[t][r] = Σ_c w[r][c] · x[t][c]` for `t < n_tokens`.
    fn matmul(
        &self,
        w: Weight<'_, Self::Buffer>,
        x: &Self::Buffer,
        n_tokens: usize,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// Three products of one input (attention's q, k and v): `outs[i][t] = ws[i] · x[t]`;
    /// the three have the same `cols`.
    fn matmul3(
        &self,
        ws: [Weight<'_, Self::Buffer>; 3],
        x: &Self::Buffer,
        n_tokens: usize,
        outs: [&mut Self::Buffer; 3],
    ) -> Result<()> {
        common_cols("matmul", &ws)?;
        for (w, out) in ws.into_iter().zip(outs) {
            self.matmul(w, x, n_tokens, out)?;
        }
        Ok(())
    }

    /// `acc[t][r] += Σ_c w[r][c] · x[t][c]`: a matmul added into `acc` (the residual
    /// stream). `tmp` (`[n_tokens][rows]` f32) is scratch for backends that multiply first
    /// and add after; a backend that adds as it stores leaves it untouched.
    fn matmul_add(
        &self,
        w: Weight<'_, Self::Buffer>,
        x: &Self::Buffer,
        n_tokens: usize,
        acc: &mut Self::Buffer,
        tmp: &mut Self::Buffer,
    ) -> Result<()> {
        self.matmul(w, x, n_tokens, tmp)?;
        self.add(acc, tmp, n_tokens * w.rows)
    }

    /// The feed-forward gate: `out[t][r] = silu(gate[r] · x[t]) · (up[r] · x[t])` for
    /// `[gate, up] = gate_up`, two matrices of one shape. `tmp` (gate and up products,
    /// each `[n_tokens][rows]` f32) is scratch for backends that multiply first; one that
    /// fuses the three steps leaves it untouched.
    fn matmul_swiglu(
        &self,
        gate_up: [Weight<'_, Self::Buffer>; 2],
        x: &Self::Buffer,
        n_tokens: usize,
        out: &mut Self::Buffer,
        tmp: [&mut Self::Buffer; 2],
    ) -> Result<()> {
        let (rows, _) = gate_up_shape("matmul", gate_up)?;
        let ([gate, up], [gate_tmp, up_tmp]) = (gate_up, tmp);
        self.matmul(gate, x, n_tokens, gate_tmp)?;
        self.matmul(up, x, n_tokens, up_tmp)?;
        self.swiglu(gate_tmp, up_tmp, n_tokens * rows, out)
    }

    /// `x[t][i] += bias[i]` (f32 bias) for `t < n_tokens`, `i < dim`.
    fn add_bias(
        &self,
        x: &mut Self::Buffer,
        bias: &Self::Buffer,
        n_tokens: usize,
        dim: usize,
    ) -> Result<()>;

    /// `out[t] = x[t] / sqrt(mean(x[t]²) + eps) · weight` (f32 weight of `dim`).
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        n_tokens: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// Rotates `x` (`[n_tokens][n_heads][head_dim]`) in place by `positions[t]`, as
    /// `rope` says (its frequency factors, when present, divide each pair's frequency:
    /// llama3 rope scaling).
    fn rope(
        &self,
        x: &mut Self::Buffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: Rope<'_, Self::Buffer>,
    ) -> Result<()>;

    /// Writes rows of `src` (`[n_tokens][kv_dim]` f32) into `cache` rows `cells[t]`, converting
    /// to the cache's element type `cache_ty` (F16 for now; Q8_0 and Q4_0 later).
    fn kv_store(
        &self,
        src: &Self::Buffer,
        kv_dim: usize,
        cells: &[u32],
        cache: &mut Self::Buffer,
        cache_ty: GgmlType,
    ) -> Result<()>;

    /// Causal attention of each query row `t` (`q`: `[n_tokens][n_heads][head_dim]`) over the
    /// cells `spans[t]` of `cache`, softmax scaled by `scale`; writes `out` like `q`.
    fn attention(
        &self,
        q: &Self::Buffer,
        cache: KvCache<'_, Self::Buffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        scale: f32,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// [`Backend::attention`] with the scores `scores` gives: scaled, then soft-capped to
    /// `softcap · tanh(score / softcap)` before the softmax (Gemma 2); a `softcap` of 0
    /// caps nothing, any other must be positive.
    fn attention_capped(
        &self,
        q: &Self::Buffer,
        cache: KvCache<'_, Self::Buffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        scores: Scores,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// One step's rotary embedding and cache write: [`Backend::rope`] on `qkv.q`
    /// (`shape.n_heads` heads) and on `qkv.k` (`shape.n_kv_heads`), then
    /// [`Backend::kv_store`] of the keys and values into `cache` at `cells`. A backend may
    /// do it in one pass.
    fn rope_and_store(
        &self,
        qkv: Qkv<'_, Self::Buffer>,
        shape: AttnShape,
        positions: &[u32],
        rope: Rope<'_, Self::Buffer>,
        cells: &[u32],
        cache: KvCacheMut<'_, Self::Buffer>,
    ) -> Result<()> {
        let (Qkv { q, k, v }, n, hd) = (qkv, positions.len(), shape.head_dim);
        self.rope(q, n, shape.n_heads, hd, positions, rope)?;
        self.rope(k, n, shape.n_kv_heads, hd, positions, rope)?;
        let kv_dim = shape.n_kv_heads * hd;
        self.kv_store(k, kv_dim, cells, cache.k, cache.ty)?;
        self.kv_store(v, kv_dim, cells, cache.v, cache.ty)
    }

    /// Mixture-of-experts routing ([`crate::moe::route_token`] for each of `n_tokens`
    /// rows of `logits`, `[n_tokens][n_expert]` f32): writes the chosen experts to `ids`
    /// (`[n_tokens][n_used]` u32) and their weights to `weights` (same shape, f32), on the
    /// device, so [`Backend::moe_ffn`] reads them without a host round trip.
    fn moe_route(
        &self,
        logits: &Self::Buffer,
        n_tokens: usize,
        routing: MoeRouting,
        ids: &mut Self::Buffer,
        weights: &mut Self::Buffer,
    ) -> Result<()>;

    /// Mixture-of-experts feed-forward added into the residual stream:
    /// `acc[t] += Σ_j weights[t][j] · down_e(silu(gate_e · x[t]) · (up_e · x[t]))` with
    /// `e = ids[t][j]`, reading only the chosen experts' rows. An id outside the layer's
    /// experts is an error (cpu) or contributes nothing (a device backend, which cannot
    /// report it from inside a recorded step).
    fn moe_ffn(
        &self,
        ffn: MoeFfn<'_, Self::Buffer>,
        acc: &mut Self::Buffer,
        scratch: MoeScratch<'_, Self::Buffer>,
    ) -> Result<()>;

    /// `out[i] = silu(gate[i]) · up[i]` for `i < n`.
    fn swiglu(
        &self,
        gate: &Self::Buffer,
        up: &Self::Buffer,
        n: usize,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// `out[i] = gelu(gate[i]) · up[i]` for `i < n`, with GELU's tanh approximation
    /// `gelu(x) = x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))` (Gemma's feed-forward).
    fn geglu(
        &self,
        gate: &Self::Buffer,
        up: &Self::Buffer,
        n: usize,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// `out[i] = act(gate[i]) · up[i]`: [`Backend::swiglu`] or [`Backend::geglu`].
    fn gated(
        &self,
        act: GateAct,
        gate: &Self::Buffer,
        up: &Self::Buffer,
        n: usize,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        match act {
            GateAct::Silu => self.swiglu(gate, up, n, out),
            GateAct::GeluTanh => self.geglu(gate, up, n, out),
        }
    }

    /// [`Backend::matmul_swiglu`] with the activation `act`:
    /// `out[t][r] = act(gate[r] · x[t]) · (up[r] · x[t])`.
    fn matmul_gated(
        &self,
        act: GateAct,
        gate_up: [Weight<'_, Self::Buffer>; 2],
        x: &Self::Buffer,
        n_tokens: usize,
        out: &mut Self::Buffer,
        tmp: [&mut Self::Buffer; 2],
    ) -> Result<()> {
        if act == GateAct::Silu {
            return self.matmul_swiglu(gate_up, x, n_tokens, out, tmp);
        }
        let (rows, _) = gate_up_shape("matmul", gate_up)?;
        let ([gate, up], [gate_tmp, up_tmp]) = (gate_up, tmp);
        self.matmul(gate, x, n_tokens, gate_tmp)?;
        self.matmul(up, x, n_tokens, up_tmp)?;
        self.gated(act, gate_tmp, up_tmp, n_tokens * rows, out)
    }

    /// `x[i] *= factor` for `i < n` (Gemma's embedding scale).
    fn scale(&self, x: &mut Self::Buffer, n: usize, factor: f32) -> Result<()>;

    /// `x[i] = cap · tanh(x[i] / cap)` for `i < n`: soft-capping of logits (Gemma 2); `cap`
    /// must be positive.
    fn softcap(&self, x: &mut Self::Buffer, n: usize, cap: f32) -> Result<()>;

    /// `x[i] += y[i]` for `i < n`.
    fn add(&self, x: &mut Self::Buffer, y: &Self::Buffer, n: usize) -> Result<()>;

    /// Copies the first `bytes` of `src` into `dst`.
    fn copy(&self, src: &Self::Buffer, dst: &mut Self::Buffer, bytes: usize) -> Result<()>;

    /// Copies `bytes` bytes of `buf` at offset `src` to offset `dst` of the same buffer; the
    /// two ranges must not overlap. Moves KV cells from one sequence's region to another's
    /// inside the cache a session reserved, so it allocates nothing.
    fn copy_within(
        &self,
        buf: &mut Self::Buffer,
        src: usize,
        dst: usize,
        bytes: usize,
    ) -> Result<()>;

    /// Where another backend on this machine can copy `buf` from without the host
    /// ([`Backend::copy_shared`]); `None` where this backend lends no memory (the cpu
    /// backend). The area names the allocation `buf` lies in; nothing is allocated.
    fn share(&self, buf: &Self::Buffer) -> Result<Option<SharedArea>> {
        let _ = buf;
        Ok(None)
    }

    /// Opens the allocation another backend lent as `area`, for [`Backend::copy_shared`];
    /// dropping the value closes it. Fails with [`ComputeError::NotShared`] where this
    /// backend borrows no memory or the area is not one it can open.
    fn open_shared(&self, area: &SharedArea) -> Result<Self::Borrowed> {
        let _ = area;
        Err(borrows_nothing(self.name()))
    }

    /// Queues a copy of `area`, a range of the allocation `view` opened, into the start of
    /// `dst`. The lender must not write the range until this backend's ops issued so far
    /// have finished ([`Backend::synchronize`]).
    fn copy_shared(
        &self,
        view: &Self::Borrowed,
        area: &SharedArea,
        dst: &mut Self::Buffer,
    ) -> Result<()> {
        let _ = (view, area, dst);
        Err(borrows_nothing(self.name()))
    }

    /// `out[r]` = [`crate::argmax::greedy`] of row `r` of `x` (`[out.len()][n]` f32), waiting
    /// for pending work first. `scratch` (at least `4 * out.len()` bytes) may be overwritten:
    /// a device backend computes the ids there and downloads only them, not every value.
    fn argmax_rows(
        &self,
        x: &Self::Buffer,
        n: usize,
        scratch: &mut Self::Buffer,
        out: &mut [u32],
    ) -> Result<()>;

    /// `out[r]` = [`crate::argmax::top_candidates`] of row `r` of `x` (`[out.len()][n]`
    /// f32) for `k` (at least 1), waiting for pending work first. `scratch` (at least
    /// [`top_rows_scratch`] bytes) may be overwritten: a device backend selects there and
    /// downloads only the candidates.
    fn top_rows(
        &self,
        x: &Self::Buffer,
        n: usize,
        k: usize,
        scratch: &mut Self::Buffer,
        out: &mut [Vec<(u32, f32)>],
    ) -> Result<()>;

    /// `out[r]` = [`crate::argmax::score_row`] of row `r` of `x` (`[out.len()][n]` f32) for
    /// the target `targets[r]` (empty `targets`: no target, NaN), waiting for pending work
    /// first: the row's log-sum-exp, which turns its logits into log-probabilities, and
    /// the target's logit. `scratch` (at least [`score_rows_scratch`] bytes) may be
    /// overwritten: a device backend reduces there and downloads two values a row. Fails
    /// on a target outside the row, or `targets` neither empty nor one a row.
    fn score_rows(
        &self,
        x: &Self::Buffer,
        n: usize,
        targets: &[u32],
        scratch: &mut Self::Buffer,
        out: &mut [(f32, f32)],
    ) -> Result<()>;
}

/// Checks `score_rows`' targets: none, or one a row inside a row of `n` values.
pub(crate) fn check_targets(targets: &[u32], rows: usize, n: usize) -> Result<()> {
    if !targets.is_empty() && targets.len() != rows {
        return Err(crate::shape_check::shape_err(
            "score_rows",
            format!("{} targets for {rows} rows", targets.len()),
        ));
    }
    if let Some(bad) = targets.iter().find(|&&t| t as usize >= n) {
        return Err(crate::shape_check::shape_err(
            "score_rows",
            format!("target {bad} is outside a row of {n} values"),
        ));
    }
    Ok(())
}

/// Scratch bytes [`Backend::score_rows`] needs for `rows` rows: a target id and two
/// results a row. `None` on overflow.
pub fn score_rows_scratch(rows: usize) -> Option<usize> {
    rows.checked_mul(12)
}

/// Scratch bytes [`Backend::top_rows`] needs for `rows` rows of `k` candidates: a count a
/// row and `k` (id, value) pairs a row. `None` on overflow.
pub fn top_rows_scratch(rows: usize, k: usize) -> Option<usize> {
    k.checked_mul(2)?
        .checked_add(1)?
        .checked_mul(rows)?
        .checked_mul(4)
}

/// What a backend that borrows no device memory answers [`Backend::open_shared`] and
/// [`Backend::copy_shared`] with.
fn borrows_nothing(backend: String) -> ComputeError {
    ComputeError::NotShared(format!("{backend} borrows no device memory"))
}
