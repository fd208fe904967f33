//! Size checks both backends run before an op touches memory: bad sizes become
//! [`ComputeError::Shape`] instead of a panic or an out-of-bounds access.

use crate::backend::{AttnSpan, KV_BLOCK_CELLS, Result, RopeParams};
use crate::error::ComputeError;

/// A shape error of `op`.
pub(crate) fn shape_err(op: &'static str, detail: String) -> ComputeError {
    ComputeError::Shape { op, detail }
}

/// Fails unless `have` bytes cover `need` bytes (`None`: the size overflowed).
pub(crate) fn need(op: &'static str, what: &str, have: usize, need: Option<usize>) -> Result<()> {
    match need {
        Some(n) if n <= have => Ok(()),
        Some(n) => Err(shape_err(
            op,
            format!("{what} holds {have} bytes but {n} are needed"),
        )),
        None => Err(shape_err(op, format!("size of {what} overflows"))),
    }
}

/// Two ranges of `bytes` bytes at `src` and `dst` inside a buffer of `have` bytes that do
/// not overlap (a copy between them is then the same in any order).
pub(crate) fn copy_within(
    op: &'static str,
    have: usize,
    src: usize,
    dst: usize,
    bytes: usize,
) -> Result<()> {
    need(op, "source range", have, src.checked_add(bytes))?;
    need(op, "destination range", have, dst.checked_add(bytes))?;
    if bytes > 0 && src.abs_diff(dst) < bytes {
        return Err(shape_err(
            op,
            format!("the {bytes}-byte ranges at {src} and {dst} overlap"),
        ));
    }
    Ok(())
}

/// The product of `dims`, or a shape error when it overflows.
pub(crate) fn elems(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| shape_err(op, format!("element count of {dims:?} overflows")))
}

/// Every span is non-empty and inside a cache of `n_cells` cells; with a ring of
/// `ring_cells` cells (see [`AttnShape::ring_cells`](crate::AttnShape)), every span is at
/// most one ring long and inside one sequence's virtual cells.
pub(crate) fn spans(
    op: &'static str,
    spans: &[AttnSpan],
    n_cells: usize,
    ring_cells: u32,
) -> Result<()> {
    let (per_seq, limit) = if ring_cells == 0 {
        (u64::MAX, n_cells as u64)
    } else {
        let r = u64::from(ring_cells);
        (2 * r, n_cells as u64 / r * 2 * r)
    };
    for (t, s) in spans.iter().enumerate() {
        let end = u64::from(s.first_cell) + u64::from(s.n_cells);
        let one_seq = ring_cells == 0
            || (s.n_cells <= ring_cells
                && u64::from(s.first_cell) / per_seq == (end - 1) / per_seq);
        if s.n_cells == 0 || end > limit || !one_seq {
            return Err(shape_err(
                op,
                format!(
                    "token {t} attends to cells {}..{end}, but the cache holds {n_cells} cells \
                     (ring of {ring_cells} cells per sequence, 0: none) and a span needs at \
                     least one",
                    s.first_cell
                ),
            ));
        }
    }
    Ok(())
}

/// The virtual cells spans may name in a cache of `n_cells` cells read through a block
/// table of `table_bytes` bytes (see [`KvCache::blocks`](crate::KvCache)): every entry's
/// cells; `n_cells` itself when the cache is not paged. A ring is never paged.
pub(crate) fn paged_cells(
    op: &'static str,
    table_bytes: Option<usize>,
    n_cells: usize,
    ring_cells: u32,
) -> Result<usize> {
    let Some(bytes) = table_bytes else {
        return Ok(n_cells);
    };
    if ring_cells != 0 {
        return Err(shape_err(
            op,
            format!("a ring of {ring_cells} cells cannot also be read through a block table"),
        ));
    }
    let entries = bytes / 4;
    elems(op, &[entries, KV_BLOCK_CELLS as usize])
        .ok()
        .filter(|&v| v <= u32::MAX as usize)
        .ok_or_else(|| {
            shape_err(
                op,
                format!("a block table of {entries} entries names more than 2^32 cells"),
            )
        })
}

/// RoPE's arguments: an even `n_rot` within the head, and a position for every token.
pub(crate) fn rope_args(
    op: &'static str,
    n_tokens: usize,
    head_dim: usize,
    positions: &[u32],
    params: &RopeParams,
) -> Result<()> {
    if !params.n_rot.is_multiple_of(2) || params.n_rot > head_dim {
        return Err(shape_err(
            op,
            format!(
                "n_rot {} must be even and at most head_dim {head_dim}",
                params.n_rot
            ),
        ));
    }
    if positions.len() < n_tokens {
        return Err(shape_err(
            op,
            format!("{} positions for {n_tokens} tokens", positions.len()),
        ));
    }
    Ok(())
}

/// A soft-cap must be a positive finite number (`cap · tanh(x / cap)`).
pub(crate) fn softcap(op: &'static str, cap: f32) -> Result<()> {
    if cap.is_finite() && cap > 0.0 {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("soft-cap {cap} must be a positive number"),
        ))
    }
}
