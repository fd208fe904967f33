//! The cpu backend: host memory as device memory, ops on a rayon thread pool.
//!
//! Every op checks its sizes (see `check`) before touching memory, then calls a kernel
//! that works on plain slices. Matrix products read quantized weights block by block
//! (`matmul`); nothing dequantizes a whole weight matrix.

mod attention;
mod buffer;
mod check;
mod elementwise;
mod f16_rows;
mod isa;
mod matmul;
mod moe;
mod q8;
mod simd;

#[cfg(test)]
mod backend_tests;
#[cfg(test)]
mod test_util;

pub use buffer::{CPU_BUFFER_ALIGN, CpuBuffer};
pub use isa::{CPU_ISA_ENV, CpuIsa};

use rayon::prelude::*;
use tether_gguf::{GgmlType, dequantize};

use crate::backend::{
    AttnShape, AttnSpan, Backend, DeviceBuffer, KvCache, MemoryInfo, Result, Rope, Scores, Weight,
};
use crate::error::ComputeError;
use crate::moe::{MoeFfn, MoeRouting, MoeScratch};
use crate::shape_check::rope_args;
use check::{elems, f32s, f32s_mut, need, shape_err};

/// The always-available backend: buffers in host memory, ops on the CPU.
pub struct CpuBackend {
    /// A pool of its own when a thread count was given; otherwise rayon's global pool.
    pool: Option<rayon::ThreadPool>,
    /// The kernel level, chosen once.
    isa: CpuIsa,
}

impl CpuBackend {
    /// A backend running its ops on `threads` threads of its own, or on rayon's global pool
    /// (one thread per core) when `threads` is `None`, with the best kernels of this CPU or
    /// the level `TETHER_CPU_ISA` names (an unknown name or a level the CPU lacks is an
    /// error).
    pub fn new(threads: Option<usize>) -> Result<Self> {
        Self::with_isa(threads, CpuIsa::from_env()?)
    }

    /// [`Self::new`] with the kernel level `isa`, which the CPU must support.
    pub fn with_isa(threads: Option<usize>, isa: CpuIsa) -> Result<Self> {
        isa.require()?;
        let pool = match threads {
            None => None,
            Some(n) => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n.max(1))
                    .thread_name(|i| format!("tether-cpu-{i}"))
                    .build()
                    .map_err(|e| {
                        ComputeError::Unavailable(format!(
                            "starting {n} cpu compute threads: {e}; try fewer threads"
                        ))
                    })?,
            ),
        };
        Ok(Self { pool, isa })
    }

    /// The kernel level the ops run at.
    pub fn isa(&self) -> CpuIsa {
        self.isa
    }

    /// Threads the ops run on.
    pub fn threads(&self) -> usize {
        self.pool
            .as_ref()
            .map_or_else(rayon::current_num_threads, |p| p.current_num_threads())
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(p) => p.install(f),
            None => f(),
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Replays = ();
    type Uploads = ();
    /// The cpu backend lends and borrows nothing: its default [`Backend::open_shared`] refuses.
    type Borrowed = std::convert::Infallible;

    fn name(&self) -> String {
        "cpu".to_string()
    }

    fn scope<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.install(f)
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        buffer::system_memory()
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        let free = buffer::system_memory().map(|m| m.free).ok();
        let refuse = |free: u64| ComputeError::OutOfMemory {
            device: self.name(),
            requested: bytes as u64,
            free,
        };
        if let Some(free) = free
            && bytes as u64 > free
        {
            return Err(refuse(free));
        }
        CpuBuffer::try_new(bytes).ok_or_else(|| refuse(free.unwrap_or(0)))
    }

    fn finish_weight(&self, w: &mut CpuBuffer, ty: GgmlType, row_len: usize) -> Result<()> {
        // Packed rows need the AVX2 kernels (and x86-64); the portable ones read the file's
        // layout.
        #[cfg(target_arch = "x86_64")]
        if w.packed.is_none() && self.isa.avx2().is_some() && matmul::packable(ty, row_len) {
            let row_bytes = row_len / 32 * 18;
            if w.bytes().is_multiple_of(row_bytes) {
                matmul::pack_q4_0(w.as_bytes_mut(), row_bytes);
                w.packed = Some(row_bytes);
            }
        }
        let _ = (w, ty, row_len);
        Ok(())
    }

    fn upload(&self, dst: &mut CpuBuffer, offset: usize, src: &[u8]) -> Result<()> {
        if dst.packed.is_some() {
            return Err(shape_err(
                "upload",
                "the buffer holds a finished weight in the packed layout; it cannot be \
                 written again"
                    .to_string(),
            ));
        }
        let end = offset.checked_add(src.len());
        need("upload", "destination buffer", dst.bytes(), end)?;
        dst.as_bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn begin_uploads(&self) -> Result<()> {
        Ok(())
    }

    // Host memory to host memory: nothing to overlap.
    fn upload_weight(
        &self,
        _uploads: &mut (),
        dst: &mut CpuBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()> {
        self.upload(dst, offset, src)
    }

    fn finish_uploads(&self, _uploads: ()) -> Result<()> {
        Ok(())
    }

    fn download(&self, src: &CpuBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len());
        need("download", "source buffer", src.bytes(), end)?;
        dst.copy_from_slice(&src.as_bytes()[offset..offset + dst.len()]);
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // Every op has finished when it returns.
        Ok(())
    }

    fn get_rows(
        &self,
        table: &CpuBuffer,
        ty: GgmlType,
        row_len: usize,
        ids: &[u32],
        out: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "get_rows";
        let row_bytes = ty
            .bytes_for(row_len as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| {
                shape_err(OP, format!("row length {row_len} is not whole {ty} blocks"))
            })?;
        let n_rows = table.bytes().checked_div(row_bytes).unwrap_or(0);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= n_rows) {
            return Err(shape_err(
                OP,
                format!("row id {bad} is outside the table of {n_rows} rows of {row_len} {ty}"),
            ));
        }
        let n = elems(OP, &[ids.len(), row_len])?;
        let out = &mut f32s_mut(OP, "output", out, n)?[..n];
        if row_len == 0 {
            return Ok(());
        }
        let packed = packed_as(OP, table, ty, row_bytes)?;
        let table = table.as_bytes();
        self.install(|| {
            out.par_chunks_mut(row_len)
                .zip(ids.par_iter())
                .try_for_each(|(o, &id)| {
                    let at = id as usize * row_bytes;
                    let row = if packed {
                        unpacked_row(table, row_bytes, id as usize)
                    } else {
                        std::borrow::Cow::Borrowed(&table[at..at + row_bytes])
                    };
                    dequantize(ty, &row, o).map_err(|e| shape_err(OP, format!("row {id}: {e}")))
                })
        })
    }

    fn matmul(
        &self,
        w: Weight<'_, CpuBuffer>,
        x: &CpuBuffer,
        n_tokens: usize,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let (w, ty, rows, cols) = (w.buf, w.ty, w.rows, w.cols);
        let row_bytes = ty
            .bytes_for(cols as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| {
                shape_err(
                    OP,
                    format!(
                        "{cols} columns are not whole {ty} blocks of {}",
                        ty.block_elems()
                    ),
                )
            })?;
        let w_bytes = row_bytes.checked_mul(rows);
        need(OP, "weight buffer", w.bytes(), w_bytes)?;
        let packed = packed_as(OP, w, ty, row_bytes)?;
        let whole = w.as_bytes();
        let w = &whole[..row_bytes * rows];
        let x = f32s(OP, "input", x, elems(OP, &[n_tokens, cols])?)?;
        let out = f32s_mut(OP, "output", out, elems(OP, &[n_tokens, rows])?)?;
        let s = matmul::Shape {
            rows,
            cols,
            n_tokens,
        };
        self.install(|| {
            #[cfg(target_arch = "x86_64")]
            if packed {
                return matmul::matmul_packed(self.isa, whole, s, x, out);
            }
            matmul::matmul(self.isa, ty, w, s, x, out)
        });
        Ok(())
    }

    fn add_bias(
        &self,
        x: &mut CpuBuffer,
        bias: &CpuBuffer,
        n_tokens: usize,
        dim: usize,
    ) -> Result<()> {
        let x = f32s_mut("add_bias", "input", x, elems("add_bias", &[n_tokens, dim])?)?;
        let bias = f32s("add_bias", "bias", bias, dim)?;
        if dim > 0 {
            self.install(|| elementwise::add_bias(x, bias));
        }
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CpuBuffer,
        weight: &CpuBuffer,
        n_tokens: usize,
        dim: usize,
        eps: f32,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "rms_norm";
        let n = elems(OP, &[n_tokens, dim])?;
        let x = f32s(OP, "input", x, n)?;
        let weight = f32s(OP, "weight", weight, dim)?;
        let out = f32s_mut(OP, "output", out, n)?;
        if dim > 0 {
            self.install(|| elementwise::rms_norm(x, weight, dim, eps, out));
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuBuffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: Rope<'_, CpuBuffer>,
    ) -> Result<()> {
        const OP: &str = "rope";
        let Rope {
            params,
            freq_factors,
        } = rope;
        rope_args(OP, n_tokens, head_dim, positions, params)?;
        let x = f32s_mut(OP, "input", x, elems(OP, &[n_tokens, n_heads, head_dim])?)?;
        let factors = match freq_factors {
            Some(f) => Some(f32s(OP, "freq_factors", f, params.n_rot / 2)?),
            None => None,
        };
        if n_heads * head_dim > 0 {
            let positions = &positions[..n_tokens];
            self.install(|| elementwise::rope(x, n_heads, head_dim, positions, params, factors));
        }
        Ok(())
    }

    fn kv_store(
        &self,
        src: &CpuBuffer,
        kv_dim: usize,
        cells: &[u32],
        cache: &mut CpuBuffer,
        cache_ty: GgmlType,
    ) -> Result<()> {
        const OP: &str = "kv_store";
        let row_bytes = check::cache_bytes(OP, cache_ty, kv_dim, "kv_dim")?;
        let src = f32s(OP, "source", src, elems(OP, &[cells.len(), kv_dim])?)?;
        let n_cells = cache.bytes().checked_div(row_bytes).unwrap_or(0);
        if let Some(&bad) = cells.iter().find(|&&c| c as usize >= n_cells) {
            return Err(shape_err(
                OP,
                format!("cell {bad} is outside the cache of {n_cells} cells"),
            ));
        }
        attention::kv_store(cache_ty, src, kv_dim, cells, cache.as_bytes_mut());
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuBuffer,
        cache: KvCache<'_, CpuBuffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        scale: f32,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        self.attention_capped(q, cache, spans, shape, Scores::scaled(scale), out)
    }

    fn attention_capped(
        &self,
        q: &CpuBuffer,
        cache: KvCache<'_, CpuBuffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        scores: Scores,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        const OP: &str = "attention";
        if scores.softcap != 0.0 {
            check::softcap(OP, scores.softcap)?;
        }
        let cache_ty = cache.ty;
        check::attention_shape(OP, shape)?;
        let head_bytes = check::cache_bytes(OP, cache_ty, shape.head_dim, "head_dim")?;
        let n = elems(OP, &[spans.len(), shape.n_heads, shape.head_dim])?;
        let q = f32s(OP, "query", q, n)?;
        let out = f32s_mut(OP, "output", out, n)?;
        let cell_bytes = elems(OP, &[shape.n_kv_heads, head_bytes])?;
        let n_cells = cache.k.bytes().min(cache.v.bytes()) / cell_bytes;
        let table_bytes = cache.blocks.map(|b| b.bytes());
        let virtual_cells = check::paged_cells(OP, table_bytes, n_cells, shape.ring_cells)?;
        check::spans(OP, spans, virtual_cells, shape.ring_cells)?;
        let table = cache
            .blocks
            .map(|b| attention::block_table(OP, b.as_bytes(), n_cells))
            .transpose()?;
        let rows = KvCache::new(cache.k.as_bytes(), cache.v.as_bytes(), cache_ty);
        let simd = self.isa.avx2();
        let table = table.as_deref();
        self.install(|| attention::attention(simd, q, rows, table, spans, shape, scores, out));
        Ok(())
    }

    fn swiglu(
        &self,
        gate: &CpuBuffer,
        up: &CpuBuffer,
        n: usize,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let gate = f32s("swiglu", "gate", gate, n)?;
        let up = f32s("swiglu", "up", up, n)?;
        let out = f32s_mut("swiglu", "output", out, n)?;
        self.install(|| elementwise::swiglu(gate, up, out));
        Ok(())
    }

    fn geglu(&self, gate: &CpuBuffer, up: &CpuBuffer, n: usize, out: &mut CpuBuffer) -> Result<()> {
        let gate = f32s("geglu", "gate", gate, n)?;
        let up = f32s("geglu", "up", up, n)?;
        let out = f32s_mut("geglu", "output", out, n)?;
        self.install(|| elementwise::geglu(gate, up, out));
        Ok(())
    }

    fn scale(&self, x: &mut CpuBuffer, n: usize, factor: f32) -> Result<()> {
        let x = f32s_mut("scale", "x", x, n)?;
        self.install(|| elementwise::scale(x, factor));
        Ok(())
    }

    fn softcap(&self, x: &mut CpuBuffer, n: usize, cap: f32) -> Result<()> {
        check::softcap("softcap", cap)?;
        let x = f32s_mut("softcap", "x", x, n)?;
        self.install(|| elementwise::softcap(x, cap));
        Ok(())
    }

    fn moe_route(
        &self,
        logits: &CpuBuffer,
        n_tokens: usize,
        routing: MoeRouting,
        ids: &mut CpuBuffer,
        weights: &mut CpuBuffer,
    ) -> Result<()> {
        self.moe_route_rows(logits, n_tokens, routing, ids, weights)
    }

    fn moe_ffn(
        &self,
        ffn: MoeFfn<'_, CpuBuffer>,
        acc: &mut CpuBuffer,
        scratch: MoeScratch<'_, CpuBuffer>,
    ) -> Result<()> {
        self.moe_ffn_rows(ffn, acc, scratch)
    }

    fn add(&self, x: &mut CpuBuffer, y: &CpuBuffer, n: usize) -> Result<()> {
        let x = f32s_mut("add", "x", x, n)?;
        let y = f32s("add", "y", y, n)?;
        self.install(|| elementwise::add(x, y));
        Ok(())
    }

    fn copy(&self, src: &CpuBuffer, dst: &mut CpuBuffer, bytes: usize) -> Result<()> {
        need("copy", "source buffer", src.bytes(), Some(bytes))?;
        need("copy", "destination buffer", dst.bytes(), Some(bytes))?;
        dst.as_bytes_mut()[..bytes].copy_from_slice(&src.as_bytes()[..bytes]);
        Ok(())
    }

    fn copy_within(&self, buf: &mut CpuBuffer, src: usize, dst: usize, bytes: usize) -> Result<()> {
        crate::shape_check::copy_within("copy_within", buf.bytes(), src, dst, bytes)?;
        buf.as_bytes_mut().copy_within(src..src + bytes, dst);
        Ok(())
    }

    fn argmax_rows(
        &self,
        x: &CpuBuffer,
        n: usize,
        _scratch: &mut CpuBuffer,
        out: &mut [u32],
    ) -> Result<()> {
        let Some(rows) = logit_rows("argmax_rows", x, n, out.len())? else {
            out.fill(0);
            return Ok(());
        };
        for (o, row) in out.iter_mut().zip(rows) {
            *o = crate::argmax::greedy(row);
        }
        Ok(())
    }

    fn top_rows(
        &self,
        x: &CpuBuffer,
        n: usize,
        k: usize,
        _scratch: &mut CpuBuffer,
        out: &mut [Vec<(u32, f32)>],
    ) -> Result<()> {
        let Some(rows) = logit_rows("top_rows", x, n, out.len())? else {
            out.iter_mut().for_each(Vec::clear);
            return Ok(());
        };
        for (o, row) in out.iter_mut().zip(rows) {
            crate::argmax::top_candidates(row, k, o);
        }
        Ok(())
    }

    fn score_rows(
        &self,
        x: &CpuBuffer,
        n: usize,
        targets: &[u32],
        _scratch: &mut CpuBuffer,
        out: &mut [(f32, f32)],
    ) -> Result<()> {
        crate::backend::check_targets(targets, out.len(), n)?;
        let Some(rows) = logit_rows("score_rows", x, n, out.len())? else {
            out.fill((f32::NEG_INFINITY, f32::NAN));
            return Ok(());
        };
        for (r, (o, row)) in out.iter_mut().zip(rows).enumerate() {
            *o = crate::argmax::score_row(row, targets.get(r).copied());
        }
        Ok(())
    }
}

/// The `rows` rows of `n` f32 a row reduction reads from `x`, after checking `x` holds
/// them; `None` when the rows are empty.
/// Whether `w` is packed, refusing a packed weight read as another type or row length
/// than it was packed with.
fn packed_as(op: &'static str, w: &CpuBuffer, ty: GgmlType, row_bytes: usize) -> Result<bool> {
    match w.packed {
        None => Ok(false),
        Some(b) if b == row_bytes && ty == GgmlType::Q4_0 => Ok(true),
        Some(b) => Err(shape_err(
            op,
            format!(
                "the weight was packed as Q4_0 rows of {b} bytes; it cannot be read as {ty} \
                 rows of {row_bytes} bytes"
            ),
        )),
    }
}

/// Row `r` of a packed table (rows of `row_bytes`) in the file's layout.
fn unpacked_row(table: &[u8], row_bytes: usize, r: usize) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_arch = "x86_64")]
    {
        let mut row = vec![0u8; row_bytes];
        matmul::unpack_row(table, row_bytes, r, &mut row);
        std::borrow::Cow::Owned(row)
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::borrow::Cow::Borrowed(&table[r * row_bytes..(r + 1) * row_bytes])
}

fn logit_rows<'a>(
    op: &'static str,
    x: &'a CpuBuffer,
    n: usize,
    rows: usize,
) -> Result<Option<std::slice::Chunks<'a, f32>>> {
    let bytes = rows.checked_mul(n).and_then(|v| v.checked_mul(4));
    need(op, "input", x.bytes(), bytes)?;
    Ok((n > 0).then(|| x.as_f32().chunks(n)))
}
