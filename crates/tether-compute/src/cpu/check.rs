//! Size checks every cpu op runs before it touches memory: they turn bad sizes into
//! [`ComputeError::Shape`] instead of a panic or an out-of-bounds access.

use crate::backend::{AttnShape, DeviceBuffer, Result};
use crate::cpu::CpuBuffer;
use crate::error::ComputeError;
pub(crate) use crate::shape_check::{elems, need, paged_cells, shape_err, softcap, spans};
use tether_gguf::GgmlType;

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
