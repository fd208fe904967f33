//! The mixture-of-experts part of a synthetic model: metadata keys and each layer's router
//! and stacked experts, named and shaped as llama.cpp writes them.

use tether_gguf::{GgmlType, GgufWriter, MetaValue};

use super::{MatrixRole, add_random};
use crate::error::ModelError;
use crate::moe::{DOWN_EXPS, GATE_EXPS, ROUTER, UP_EXPS};

/// Experts of every layer of a synthetic model.
#[derive(Clone, Copy, Debug)]
pub(super) struct Experts {
    n_expert: usize,
    n_used: usize,
    n_ff: usize,
}

impl Experts {
    pub(super) const fn new(n_expert: usize, n_used: usize, n_ff: usize) -> Self {
        Self {
            n_expert,
            n_used,
            n_ff,
        }
    }

    /// The `{arch}.expert_*` keys. Mixtral (`llama`) files carry the expert width as
    /// `feed_forward_length`, which the caller writes; qwen3moe files have a key for it.
    pub(super) fn add_metadata(&self, w: &mut GgufWriter, arch: &str) {
        let u32v = |n: usize| MetaValue::U32(n as u32);
        w.add_metadata(format!("{arch}.expert_count"), u32v(self.n_expert));
        w.add_metadata(format!("{arch}.expert_used_count"), u32v(self.n_used));
        if arch != "llama" {
            w.add_metadata(
                format!("{arch}.expert_feed_forward_length"),
                u32v(self.n_ff),
            );
        }
    }

    /// Layer `layer`'s router (f32, as llama.cpp's quantizer leaves it) and stacked experts
    /// of the types `pick(role, row length)` gives, for a model `e` wide.
    pub(super) fn add_layer(
        &self,
        w: &mut GgufWriter,
        layer: usize,
        e: usize,
        pick: impl Fn(MatrixRole, usize) -> GgmlType,
        next_seed: &mut impl FnMut() -> u64,
    ) -> Result<(), ModelError> {
        let (ff, n) = (self.n_ff, self.n_expert);
        let name = |s: &str| format!("blk.{layer}.{s}");
        let amp = |cols: usize| (3.0 / cols as f32).sqrt();
        // Router scores spread over a few units, so that the experts' ranks are clear.
        add_random(
            w,
            name(ROUTER),
            GgmlType::F32,
            &[e, n],
            4.0 * amp(e),
            next_seed(),
        )?;
        for (suffix, role, dims, cols) in [
            (GATE_EXPS, MatrixRole::FfnGate, [e, ff, n], e),
            (UP_EXPS, MatrixRole::FfnUp, [e, ff, n], e),
            (DOWN_EXPS, MatrixRole::FfnDown, [ff, e, n], ff),
        ] {
            add_random(
                w,
                name(suffix),
                pick(role, cols),
                &dims,
                amp(cols),
                next_seed(),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{SynthShape, build};
    use crate::config::ModelConfig;
    use tether_gguf::GgmlType;

    /// The MoE shapes in q4_k: the stacked experts dominate their size (Qwen3-30B-A3B
    /// holds 29 billion expert weights, Mixtral 8x7B 45 billion), counted without writing.
    #[test]
    fn moe_shapes_have_the_size_of_their_experts() {
        for (shape, gib) in [
            (SynthShape::Qwen3_30bA3b, 15.5..16.5),
            (SynthShape::Mixtral8x7b, 24.0..25.0),
        ] {
            let w = build(shape, GgmlType::Q4K.into(), 1).unwrap();
            let size = w.tensor_data_bytes() as f64 / f64::from(1u32 << 30);
            assert!(gib.contains(&size), "{}: {size} GiB", shape.name());
        }
    }

    #[test]
    fn tiny_moe_reads_back_with_its_experts() {
        let w = build(SynthShape::TinyQwen3Moe, GgmlType::Q4K.into(), 1).unwrap();
        let mut bytes = Vec::new();
        w.write_to(&mut bytes, "mem").unwrap();
        let file = tether_gguf::GgufFile::from_bytes("mem", bytes).unwrap();
        let moe = ModelConfig::from_gguf(&file).unwrap().moe.unwrap();
        assert_eq!((moe.n_expert, moe.n_used, moe.n_ff_exp), (8, 2, 256));
        let t = file.tensor("blk.1.ffn_down_exps.weight").unwrap();
        assert_eq!((t.ty, t.dims.clone()), (GgmlType::Q4K, vec![256, 256, 8]));
        let router = file.tensor("blk.0.ffn_gate_inp.weight").unwrap();
        assert_eq!(
            router.ty,
            GgmlType::F32,
            "llama.cpp leaves routers unquantized"
        );
    }
}
