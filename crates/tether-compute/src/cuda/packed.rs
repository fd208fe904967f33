//! Q4_0, Q8_0, Q6_K, Q3_K and IQ4_XS weights rewritten in place into the packed layouts of
//! kernels/matvec_packed.cu and kernels/matvec_kquant.cu once they are loaded
//! ([`crate::Backend::finish_weight`]): each group of 8 blocks keeps its bytes but puts the 8
//! scales first, so the decode kernels read a block's quants in 16-byte loads instead of
//! 2-byte ones (GGUF's 18-, 34-, 210- and 110-byte blocks are only 2-byte aligned, its
//! 136-byte IQ4_XS blocks 8-byte). Every kernel that reads a
//! weight (products, the GEMM's decoding, embedding rows) is told the layout through the
//! type id [`kernel_type_id`] gives.

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::check::{row_bytes, shape_err};
use super::kernel_files::{define, source};
use super::launch::{Arg, grid_for};
use super::matvec::XQ_MAX_COLS;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{DeviceBuffer, Result};

/// Values per packed group of Q4_0 / Q8_0 (8 blocks of 32) and of Q6_K / Q3_K / IQ4_XS (8
/// blocks of 256);
/// a packed row holds whole groups.
fn group_values(ty: GgmlType) -> usize {
    8 * ty.block_elems()
}
/// Threads per block of the pack kernels (`PACK_THREADS` in matvec_packed.cu).
const PACK_THREADS: u32 = define(source::MATVEC_PACKED, "PACK_THREADS") as u32;
/// Threads per block of pack_q6_k, pack_q3_k and pack_iq4_xs (one block a group).
const PACK_K_THREADS: u32 = 128;
/// Kernel type ids of the packed layouts (`TY_Q4_0P` ... in common.cuh).
const TY_Q4_0P: i32 = define(source::COMMON, "TY_Q4_0P") as i32;
const TY_Q8_0P: i32 = define(source::COMMON, "TY_Q8_0P") as i32;
const TY_Q6_KP: i32 = define(source::COMMON, "TY_Q6_KP") as i32;
const TY_Q3_KP: i32 = define(source::COMMON, "TY_Q3_KP") as i32;
const TY_IQ4_XSP: i32 = define(source::COMMON, "TY_IQ4_XSP") as i32;

/// Whether rows of `row_len` values of `ty` can be packed: whole groups, and no wider than
/// the 8-bit activation rows the packed kernels read (they have no f32 twin).
pub(super) fn packable(ty: GgmlType, row_len: usize) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q6K | GgmlType::Q3K | GgmlType::IQ4XS
    ) && row_len > 0
        && row_len.is_multiple_of(group_values(ty))
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

/// The type id of `ty` in the packed layout (only Q4_0, Q8_0, Q6_K, Q3_K and IQ4_XS are
/// ever packed).
pub(super) fn packed_type_id(ty: GgmlType) -> i32 {
    match ty {
        GgmlType::Q4_0 => TY_Q4_0P,
        GgmlType::Q8_0 => TY_Q8_0P,
        GgmlType::Q6K => TY_Q6_KP,
        GgmlType::Q3K => TY_Q3_KP,
        GgmlType::IQ4XS => TY_IQ4_XSP,
        _ => ty.id() as i32,
    }
}

/// The name stem of the packed decode kernels of matvec_packed.cu for `ty` (`q4_0`,
/// `q8_0`); packed Q6_K, Q3_K and IQ4_XS take matvec_kquant.cu's.
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
        let (kernel, cfg) = match ty {
            GgmlType::Q4_0 => ("pack_q4_0", grid_for(n_groups, PACK_THREADS)),
            GgmlType::Q8_0 => ("pack_q8_0", grid_for(n_groups, PACK_THREADS)),
            _ => (
                match ty {
                    GgmlType::Q6K => "pack_q6_k",
                    GgmlType::Q3K => "pack_q3_k",
                    _ => "pack_iq4_xs",
                },
                LaunchConfig {
                    // Grid-stride: a block per group up to the cap.
                    grid_dim: (n_groups.min(1 << 16) as u32, 1, 1),
                    block_dim: (PACK_K_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                },
            ),
        };
        let at = self.addr(OP, "weight", w)?;
        self.run(kernel, cfg, &[Arg::Ptr(at), Arg::U64(n_groups as u64)])?;
        w.packed = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_groups_of_q4_0_q8_0_and_q6_k_pack() {
        assert!(packable(GgmlType::Q4_0, 4096));
        assert!(packable(GgmlType::Q8_0, 14336));
        assert!(!packable(GgmlType::Q4_0, 896), "896 values are 3.5 groups");
        assert!(!packable(GgmlType::Q4K, 4096));
        assert!(packable(GgmlType::Q6K, 14336), "7 groups of 2048");
        assert!(!packable(GgmlType::Q6K, 3584), "1.75 groups of 2048");
        assert!(packable(GgmlType::Q3K, 4096));
        assert!(!packable(GgmlType::Q2K, 4096));
        assert!(packable(GgmlType::IQ4XS, 14336));
        assert!(!packable(GgmlType::IQ4XS, 768));
        assert!(!packable(GgmlType::F16, 4096));
        assert!(!packable(GgmlType::Q8_0, 0));
        assert!(!packable(GgmlType::Q4_0, XQ_MAX_COLS + 256));
    }
}
