//! Q4_0 and Q8_0 weights rewritten in place into the packed layout of
//! kernels/matvec_packed.cu once they are loaded ([`crate::Backend::finish_weight`]): each
//! group of 8 blocks keeps its bytes but puts the 8 scales first, so the decode kernels read
//! a block's quants in 16-byte loads instead of 2-byte ones. Every kernel that reads a
//! weight (products, the GEMM's decoding, embedding rows) is told the layout through the
//! type id [`kernel_type_id`] gives.

use tether_gguf::GgmlType;

use super::check::{row_bytes, shape_err};
use super::launch::{Arg, grid_for};
use super::matvec::XQ_MAX_COLS;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};

/// Values per packed group (8 blocks of 32); a packed row holds whole groups.
const GROUP_VALUES: usize = 256;
/// Threads per block of the pack kernels; must match PACK_THREADS in matvec_packed.cu.
const PACK_THREADS: u32 = 64;
/// Kernel type ids of the packed layouts; must match TY_Q4_0P / TY_Q8_0P in common.cuh.
const TY_Q4_0P: i32 = 1002;
const TY_Q8_0P: i32 = 1008;

/// Whether rows of `row_len` values of `ty` can be packed: whole groups, and no wider than
/// the 8-bit activation rows the packed kernels read (they have no f32 twin).
pub(super) fn packable(ty: GgmlType, row_len: usize) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q8_0)
        && row_len > 0
        && row_len.is_multiple_of(GROUP_VALUES)
        && row_len <= XQ_MAX_COLS
}

/// The type id the kernels get for `ty` as `buf` stores it.
pub(super) fn kernel_type_id(buf: &CudaBuffer, ty: GgmlType) -> i32 {
    if buf.packed {
        packed_type_id(ty)
    } else {
        ty.id() as i32
    }
}

/// The type id of `ty` in the packed layout (only Q4_0 and Q8_0 are ever packed).
pub(super) fn packed_type_id(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => TY_Q4_0P,
        GgmlType::Q8_0 => TY_Q8_0P,
        _ => ty.id() as i32,
    }
}

/// The name stem of the packed decode kernels for `ty` (`q4_0`, `q8_0`).
pub(super) fn packed_stem(ty: GgmlType) -> Option<&'static str> {
    match ty {
        GgmlType::Q4_0 => Some("q4_0"),
        GgmlType::Q8_0 => Some("q8_0"),
        _ => None,
    }
}

impl CudaBackend {
    /// Packs `w` (rows of `row_len` values of `ty`, the whole buffer) in place when its type
    /// and row length allow; otherwise leaves it as it is.
    pub(super) fn pack_weight(
        &self,
        w: &mut CudaBuffer,
        ty: GgmlType,
        row_len: usize,
    ) -> Result<()> {
        const OP: &str = "finish_weight";
        if w.packed || !packable(ty, row_len) || w.bytes() == 0 {
            return Ok(());
        }
        let rb = row_bytes(OP, ty, row_len)?;
        if !w.bytes().is_multiple_of(rb) {
            return Err(shape_err(
                OP,
                format!("{} bytes are not whole rows of {row_len} {ty}", w.bytes()),
            ));
        }
        let n_groups = w.bytes() / (8 * ty.block_bytes());
        let kernel = if ty == GgmlType::Q4_0 {
            "pack_q4_0"
        } else {
            "pack_q8_0"
        };
        let at = self.addr(OP, "weight", w)?;
        self.run(
            kernel,
            grid_for(n_groups, PACK_THREADS),
            &[Arg::Ptr(at), Arg::U64(n_groups as u64)],
        )?;
        w.packed = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_groups_of_q4_0_and_q8_0_pack() {
        assert!(packable(GgmlType::Q4_0, 4096));
        assert!(packable(GgmlType::Q8_0, 14336));
        assert!(!packable(GgmlType::Q4_0, 896), "896 values are 3.5 groups");
        assert!(!packable(GgmlType::Q4K, 4096));
        assert!(!packable(GgmlType::F16, 4096));
        assert!(!packable(GgmlType::Q8_0, 0));
        assert!(!packable(GgmlType::Q4_0, XQ_MAX_COLS + 256));
    }
}
