//! Size checks every CUDA op runs before launching: a kernel reading past a buffer would
//! corrupt memory silently, so bad sizes become [`ComputeError::Shape`] here.

use tether_gguf::GgmlType;

use crate::backend::{AttnShape, DeviceBuffer, Result};
use crate::error::ComputeError;
pub(crate) use crate::shape_check::{elems, need, paged_cells, shape_err, spans};

/// An unsupported-type error of `op` on the CUDA backend.
pub(crate) fn unsupported(op: &'static str, ty: GgmlType) -> ComputeError {
    ComputeError::Unsupported {
        op,
        ty,
        backend: "cuda".to_string(),
    }
}

/// Fails unless `buf` holds `n` f32 values.
pub(crate) fn f32s(op: &'static str, what: &str, buf: &impl DeviceBuffer, n: usize) -> Result<()> {
    need(op, what, buf.bytes(), n.checked_mul(4))
}

/// Bytes of one row of `elems` values of `ty`, or a shape error when `elems` is not whole
/// blocks.
pub(crate) fn row_bytes(op: &'static str, ty: GgmlType, elems: usize) -> Result<usize> {
    ty.bytes_for(elems as u64)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| {
            shape_err(
                op,
                format!(
                    "{elems} values are not whole {ty} blocks of {}",
                    ty.block_elems()
                ),
            )
        })
}

/// Weight types the matvec and get_rows kernels decode: every type the cpu backend serves.
/// (No wildcard: a new type must be given kernels, or refused here on purpose.)
pub(crate) fn weight_type_supported(ty: GgmlType) -> bool {
    match ty {
        GgmlType::F32
        | GgmlType::F16
        | GgmlType::BF16
        | GgmlType::Q4_0
        | GgmlType::Q4_1
        | GgmlType::Q5_0
        | GgmlType::Q5_1
        | GgmlType::Q8_0
        | GgmlType::Q8_1
        | GgmlType::Q2K
        | GgmlType::Q3K
        | GgmlType::Q4K
        | GgmlType::Q5K
        | GgmlType::Q6K
        | GgmlType::Q8K
        | GgmlType::IQ4NL
        | GgmlType::IQ4XS => true,
    }
}

/// Cache element types the attention and kv_store kernels handle.
pub(crate) fn cache_type_supported(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_0)
}

/// Heads exist, group evenly onto KV heads, and fit the attention kernel (≤ 256 per head).
pub(crate) fn attention_shape(op: &'static str, s: AttnShape) -> Result<()> {
    if s.n_heads == 0
        || s.n_kv_heads == 0
        || s.head_dim == 0
        || !s.n_heads.is_multiple_of(s.n_kv_heads)
        || s.head_dim > 256
    {
        return Err(shape_err(
            op,
            format!(
                "{} query heads cannot share {} KV heads of {} elements \
                 (the CUDA kernel takes heads of 1..=256 elements)",
                s.n_heads, s.n_kv_heads, s.head_dim
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::AttnSpan;

    #[test]
    fn partial_blocks_and_overflow_are_shape_errors() {
        assert!(row_bytes("t", GgmlType::Q4K, 255).is_err());
        assert_eq!(row_bytes("t", GgmlType::Q4K, 512).unwrap(), 288);
        assert!(elems("t", &[usize::MAX, 2]).is_err());
        assert!(need("t", "x", 8, Some(9)).is_err());
        assert!(need("t", "x", 8, None).is_err());
        assert!(need("t", "x", 8, Some(8)).is_ok());
    }

    #[test]
    fn spans_outside_the_cache_are_refused() {
        let ok = AttnSpan {
            first_cell: 2,
            n_cells: 3,
        };
        assert!(spans("t", &[ok], 5, 0).is_ok());
        assert!(spans("t", &[ok], 4, 0).is_err());
        let empty = AttnSpan {
            first_cell: 0,
            n_cells: 0,
        };
        assert!(spans("t", &[empty], 5, 0).is_err());
        // Rings of 4 cells in a cache of 8: two sequences, virtual cells 0..8 and 8..16.
        let wraps = AttnSpan {
            first_cell: 10,
            n_cells: 4,
        };
        assert!(spans("t", &[wraps], 8, 4).is_ok());
        for bad in [(10, 5), (7, 2), (16, 1)] {
            let span = AttnSpan {
                first_cell: bad.0,
                n_cells: bad.1,
            };
            assert!(spans("t", &[span], 8, 4).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn oversized_heads_are_refused() {
        let s = AttnShape {
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 512,
            ring_cells: 0,
        };
        assert!(attention_shape("t", s).is_err());
        assert!(
            attention_shape(
                "t",
                AttnShape {
                    head_dim: 128,
                    ring_cells: 0,
                    ..s
                }
            )
            .is_ok()
        );
        assert!(
            attention_shape(
                "t",
                AttnShape {
                    n_kv_heads: 3,
                    head_dim: 128,
                    ring_cells: 0,
                    ..s
                }
            )
            .is_err()
        );
    }
}
