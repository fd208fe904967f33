//! Size checks every cpu op runs before it touches memory: they turn bad sizes into
//! [`ComputeError::Shape`] instead of a panic or an out-of-bounds access.

use crate::backend::{AttnShape, AttnSpan, DeviceBuffer, Result};
use crate::cpu::CpuBuffer;
use crate::error::ComputeError;
use tether_gguf::GgmlType;

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

/// The product of `dims`, or a shape error when it overflows.
pub(crate) fn elems(op: &'static str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| shape_err(op, format!("element count of {dims:?} overflows")))
}

/// The first `n` f32 of `buf`, or a shape error when it holds fewer.
pub(crate) fn f32s<'a>(
    op: &'static str,
    what: &str,
    buf: &'a CpuBuffer,
    n: usize,
) -> Result<&'a [f32]> {
    need(op, what, buf.bytes(), n.checked_mul(4))?;
    Ok(&buf.as_f32()[..n])
}

/// The first `n` f32 of `buf`, mutable, or a shape error when it holds fewer.
pub(crate) fn f32s_mut<'a>(
    op: &'static str,
    what: &str,
    buf: &'a mut CpuBuffer,
    n: usize,
) -> Result<&'a mut [f32]> {
    need(op, what, buf.bytes(), n.checked_mul(4))?;
    Ok(&mut buf.as_f32_mut()[..n])
}

/// Bytes of `elems` cache elements of `ty`: F16, or Q8_0/Q4_0 when `elems` (named `what`)
/// is whole 32-blocks.
pub(crate) fn cache_bytes(
    op: &'static str,
    ty: GgmlType,
    elems: usize,
    what: &str,
) -> Result<usize> {
    if !matches!(ty, GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_0) {
        return Err(ComputeError::Unsupported {
            op,
            ty,
            backend: "cpu".to_string(),
        });
    }
    ty.bytes_for(elems as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| {
            shape_err(
                op,
                format!(
                    "{what} {elems} is not whole {ty} blocks of {}",
                    ty.block_elems()
                ),
            )
        })
}

/// Heads exist, are non-empty, and query heads group evenly onto KV heads.
pub(crate) fn attention_shape(op: &'static str, s: AttnShape) -> Result<()> {
    if s.n_heads == 0
        || s.n_kv_heads == 0
        || s.head_dim == 0
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
    {
        return Err(shape_err(
            op,
            format!(
                "{} query heads cannot share {} KV heads of {} elements",
                s.n_heads, s.n_kv_heads, s.head_dim
            ),
        ));
    }
    Ok(())
}

/// Every span is non-empty and inside a cache of `n_cells` cells.
pub(crate) fn spans(op: &'static str, spans: &[AttnSpan], n_cells: usize) -> Result<()> {
    for (t, s) in spans.iter().enumerate() {
        let end = u64::from(s.first_cell) + u64::from(s.n_cells);
        if s.n_cells == 0 || end > n_cells as u64 {
            return Err(shape_err(
                op,
                format!(
                    "token {t} attends to cells {}..{end}, but the cache holds {n_cells} cells \
                     and a span needs at least one",
                    s.first_cell
                ),
            ));
        }
    }
    Ok(())
}
