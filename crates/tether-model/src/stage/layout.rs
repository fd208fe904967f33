//! The weights a stage allocates for its file tensors: one each, except fused tensors
//! (Phi-3's `attn_qkv` and gate-and-up `ffn_up`), held as one weight per part so that the
//! products take each part as a matrix of its own.

use tether_gguf::GgmlType;

use super::{TensorSlot, slot_bytes};
use crate::arch;
use crate::config::ModelConfig;
use crate::error::ModelError;

/// One weight buffer of a stage.
pub(super) struct WeightSlot {
    /// The file tensor's name, or `name#part` for a part of a fused one.
    pub(super) name: String,
    pub(super) ty: GgmlType,
    /// Values per row.
    pub(super) row_len: usize,
    pub(super) bytes: u64,
    /// The fused file tensor it is part of, and its first byte there.
    pub(super) part_of: Option<(String, u64)>,
}

/// The weights holding `tensors`, in order.
pub(super) fn weight_layout(
    cfg: &ModelConfig,
    tensors: &[TensorSlot],
) -> Result<Vec<WeightSlot>, ModelError> {
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        let row_len = t.dims.first().map_or(0, |&d| d as usize);
        let Some(parts) = arch::fused_parts(cfg, &t.name) else {
            out.push(WeightSlot {
                name: t.name.clone(),
                ty: t.ty,
                row_len,
                bytes: t.bytes,
                part_of: None,
            });
            continue;
        };
        // A part is a block of whole rows, so a byte range of the file tensor.
        let mut start = 0;
        for (label, rows) in parts {
            let bytes = slot_bytes(&t.name, t.ty, &[row_len as u64, rows as u64])?;
            out.push(WeightSlot {
                name: arch::part_name(&t.name, label),
                ty: t.ty,
                row_len,
                bytes,
                part_of: Some((t.name.clone(), start)),
            });
            start += bytes;
        }
        if start != t.bytes {
            return Err(ModelError::InvalidArgument(format!(
                "tensor '{}': {} bytes given, its parts hold {start}",
                t.name, t.bytes
            )));
        }
    }
    Ok(out)
}
