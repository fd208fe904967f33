//! Typed operands of the [`crate::Backend`] ops: a weight matrix is one value (buffer,
//! type and shape) instead of four arguments that could be passed in the wrong order, and
//! the KV cache, the rotary embedding and the score scaling of attention likewise. All are
//! borrows (and `Copy` where they only read), so passing them costs what the loose
//! arguments did.

use std::fmt;

use tether_gguf::GgmlType;

use crate::backend::{Result, RopeParams};
use crate::shape_check::shape_err;

/// A weight matrix: `rows` rows of `cols` values of `ty` at the start of `buf`, row-major
/// (GGUF's `ne[0]` = `cols` is the contiguous dimension).
pub struct Weight<'a, B: ?Sized> {
    /// The buffer holding it (it may hold more after it).
    pub buf: &'a B,
    /// Element type, as in the file.
    pub ty: GgmlType,
    /// Output rows.
    pub rows: usize,
    /// Values a row: the input width.
    pub cols: usize,
}

impl<'a, B: ?Sized> Weight<'a, B> {
    /// `rows` rows of `cols` values of `ty` in `buf`.
    pub fn new(buf: &'a B, ty: GgmlType, rows: usize, cols: usize) -> Self {
        Self {
            buf,
            ty,
            rows,
            cols,
        }
    }

    /// The first `rows` rows of this matrix (a slice of a larger one).
    pub fn with_rows(self, rows: usize) -> Self {
        Self { rows, ..self }
    }
}

impl<B: ?Sized> Clone for Weight<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for Weight<'_, B> {}

impl<B: ?Sized> fmt::Debug for Weight<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Weight({} [{}][{}])", self.ty, self.rows, self.cols)
    }
}

/// Checks that a gate and an up matrix have one shape, as a gated product needs (their
/// types may differ); returns `(rows, cols)`.
pub(crate) fn gate_up_shape<B: ?Sized>(
    op: &'static str,
    [gate, up]: [Weight<'_, B>; 2],
) -> Result<(usize, usize)> {
    if (gate.rows, gate.cols) != (up.rows, up.cols) {
        return Err(shape_err(
            op,
            format!(
                "gate is [{}][{}] but up is [{}][{}]",
                gate.rows, gate.cols, up.rows, up.cols
            ),
        ));
    }
    Ok((gate.rows, gate.cols))
}

/// Checks that matrices multiplying one input have its width; returns it.
pub(crate) fn common_cols<B: ?Sized>(op: &'static str, ws: &[Weight<'_, B>]) -> Result<usize> {
    let cols = ws.first().map_or(0, |w| w.cols);
    if let Some(w) = ws.iter().find(|w| w.cols != cols) {
        return Err(shape_err(
            op,
            format!("matrices of one input have {cols} and {} columns", w.cols),
        ));
    }
    Ok(cols)
}

/// One layer's KV cache as attention reads it: `[cells][n_kv_heads][head_dim]` of `ty` in
/// `k` and in `v`, and for a paged cache the block table that places its virtual cells.
pub struct KvCache<'a, B: ?Sized> {
    /// Keys.
    pub k: &'a B,
    /// Values.
    pub v: &'a B,
    /// Element type of both (F16, Q8_0 or Q4_0).
    pub ty: GgmlType,
    /// A paged cache's block table: little-endian u32 block numbers, entry `i` the block
    /// that holds virtual cells `[i·KV_BLOCK_CELLS, (i+1)·KV_BLOCK_CELLS)` (see
    /// [`kv_cell`](crate::kv_cell)). `None`: spans index cells directly (or a ring's).
    pub blocks: Option<&'a B>,
}

impl<'a, B: ?Sized> KvCache<'a, B> {
    /// Keys `k` and values `v` of `ty`, read at the cells spans name.
    pub fn new(k: &'a B, v: &'a B, ty: GgmlType) -> Self {
        Self {
            k,
            v,
            ty,
            blocks: None,
        }
    }

    /// The same cache read through the block table `blocks` (see [`Self::blocks`]).
    pub fn paged(self, blocks: &'a B) -> Self {
        Self {
            blocks: Some(blocks),
            ..self
        }
    }
}

impl<B: ?Sized> Clone for KvCache<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for KvCache<'_, B> {}

/// One layer's KV cache as a step writes it (see [`KvCache`]).
pub struct KvCacheMut<'a, B: ?Sized> {
    /// Keys.
    pub k: &'a mut B,
    /// Values.
    pub v: &'a mut B,
    /// Element type of both.
    pub ty: GgmlType,
}

impl<'a, B: ?Sized> KvCacheMut<'a, B> {
    /// Keys `k` and values `v` of `ty`.
    pub fn new(k: &'a mut B, v: &'a mut B, ty: GgmlType) -> Self {
        Self { k, v, ty }
    }
}

/// The rotary embedding of one call: its parameters and, for llama3-style scaling, the
/// f32 factors (`n_rot / 2`) that divide each pair's frequency.
pub struct Rope<'a, B: ?Sized> {
    /// The layer's parameters.
    pub params: &'a RopeParams,
    /// `rope_freqs.weight`, when the model has it.
    pub freq_factors: Option<&'a B>,
}

impl<'a, B: ?Sized> Rope<'a, B> {
    /// `params`, with `freq_factors` when the model has them.
    pub fn new(params: &'a RopeParams, freq_factors: Option<&'a B>) -> Self {
        Self {
            params,
            freq_factors,
        }
    }
}

impl<B: ?Sized> Clone for Rope<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: ?Sized> Copy for Rope<'_, B> {}

/// One step's projected queries and keys (rotated in place) and values.
pub struct Qkv<'a, B: ?Sized> {
    /// `[n_tokens][n_heads][head_dim]` f32.
    pub q: &'a mut B,
    /// `[n_tokens][n_kv_heads][head_dim]` f32.
    pub k: &'a mut B,
    /// `[n_tokens][n_kv_heads][head_dim]` f32.
    pub v: &'a B,
}

impl<'a, B: ?Sized> Qkv<'a, B> {
    /// Queries `q`, keys `k` and values `v`.
    pub fn new(q: &'a mut B, k: &'a mut B, v: &'a B) -> Self {
        Self { q, k, v }
    }
}

/// How attention turns a query-key product into a score before the softmax: multiplied by
/// `scale`, then soft-capped to `softcap · tanh(score / softcap)` (Gemma 2) unless
/// `softcap` is 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scores {
    /// Usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// 0, or a positive cap.
    pub softcap: f32,
}

impl Scores {
    /// Scores scaled by `scale` and not capped.
    pub fn scaled(scale: f32) -> Self {
        Self::capped(scale, 0.0)
    }

    /// Scores scaled by `scale` and capped at `softcap` (0: not capped).
    pub fn capped(scale: f32, softcap: f32) -> Self {
        Self { scale, softcap }
    }
}
