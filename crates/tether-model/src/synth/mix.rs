//! What `gguf synth --type` asks for: one ggml type for every matrix, or one of the mixed
//! file types llama.cpp's quantizer writes (`Q4_K_M` and friends), which choose a type per
//! matrix from its role and layer.
//!
//! The mixes follow `llama_tensor_get_type` in llama.cpp's `src/llama-quant.cpp` for dense
//! models (no experts, not Falcon) quantized without an importance matrix. `n` is the layer
//! count, `gqa` the query heads per KV head, and "more bits" the layers
//! `i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2` (integer division):
//!
//! | mix | base | output | attn_v | ffn_down | attn_output |
//! |---|---|---|---|---|---|
//! | `q2_k_mix` (llama.cpp `Q2_K`) | q2_k | q6_k | q4_k if gqa ≥ 4, else q3_k | q3_k | q3_k |
//! | `q3_k_m` | q3_k | q6_k | q5_k for layers 0, 1, else q4_k | q5_k if i < n/16, else q4_k | q4_k |
//! | `q4_k_m` | q4_k | q6_k | q6_k on "more bits" layers | q6_k on "more bits" layers | base |
//! | `q5_k_m` | q5_k | q6_k | q6_k on "more bits" layers | q6_k on "more bits" layers | base |
//! | `iq4_xs_mix` (llama.cpp `IQ4_XS`) | iq4_xs | q6_k | q5_k if gqa ≥ 4 | q5_k if i < n/8 | base |
//!
//! On a 70B-class model (llama.cpp's `LLM_TYPE_70B`: 80 layers with grouped KV heads) an
//! attn_v of q3_k or q4_k becomes q5_k, since it is 8× smaller than attn_q there. Every
//! other matrix (token_embd, attn_q, attn_k, ffn_gate, ffn_up) has the base type; a model
//! whose output reuses token_embd gives token_embd the output's type. The plain names
//! (`q2_k`, `iq4_xs`) keep meaning one type for every matrix, hence the `_mix` suffix on the
//! two file types that share a type's name.

use std::fmt;

use tether_gguf::GgmlType;

/// A weight matrix of a layer-stacked model, by the role its tensor name gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixRole {
    /// `token_embd.weight` of a model with its own output matrix.
    TokenEmbd,
    /// `output.weight`, or `token_embd.weight` where the output reuses it.
    Output,
    /// `blk.N.attn_q.weight`.
    AttnQ,
    /// `blk.N.attn_k.weight`.
    AttnK,
    /// `blk.N.attn_v.weight`.
    AttnV,
    /// `blk.N.attn_output.weight`.
    AttnOutput,
    /// `blk.N.ffn_gate.weight`.
    FfnGate,
    /// `blk.N.ffn_up.weight`.
    FfnUp,
    /// `blk.N.ffn_down.weight`.
    FfnDown,
}

/// A llama.cpp file type that mixes quant types per matrix (see the module table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// llama.cpp's `Q2_K` file type.
    Q2K,
    /// `Q3_K_M`.
    Q3KM,
    /// `Q4_K_M`.
    Q4KM,
    /// `Q5_K_M`.
    Q5KM,
    /// llama.cpp's `IQ4_XS` file type.
    IQ4XS,
}

impl QuantMix {
    /// Every mix.
    pub const ALL: [QuantMix; 5] = [
        QuantMix::Q2K,
        QuantMix::Q3KM,
        QuantMix::Q4KM,
        QuantMix::Q5KM,
        QuantMix::IQ4XS,
    ];

    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q2K => "q2_k_mix",
            QuantMix::Q3KM => "q3_k_m",
            QuantMix::Q4KM => "q4_k_m",
            QuantMix::Q5KM => "q5_k_m",
            QuantMix::IQ4XS => "iq4_xs_mix",
        }
    }

    /// The type of every matrix no rule raises.
    pub fn base(self) -> GgmlType {
        match self {
            QuantMix::Q2K => GgmlType::Q2K,
            QuantMix::Q3KM => GgmlType::Q3K,
            QuantMix::Q4KM => GgmlType::Q4K,
            QuantMix::Q5KM => GgmlType::Q5K,
            QuantMix::IQ4XS => GgmlType::IQ4XS,
        }
    }

    fn type_for(self, role: MatrixRole, layer: usize, n_layer: usize, gqa: usize) -> GgmlType {
        use GgmlType::{Q3K, Q4K, Q5K, Q6K};
        use QuantMix as M;
        let base = self.base();
        let more_bits = more_bits(layer, n_layer);
        let class_70b = n_layer == 80 && gqa > 1;
        let ty = match (role, self) {
            (MatrixRole::Output, _) => Q6K,
            (MatrixRole::AttnV, M::Q2K) => {
                if gqa >= 4 {
                    Q4K
                } else {
                    Q3K
                }
            }
            (MatrixRole::AttnV, M::Q3KM) => {
                if layer < 2 {
                    Q5K
                } else {
                    Q4K
                }
            }
            (MatrixRole::AttnV | MatrixRole::FfnDown, M::Q4KM | M::Q5KM) if more_bits => Q6K,
            (MatrixRole::AttnV, M::IQ4XS) if gqa >= 4 => Q5K,
            (MatrixRole::FfnDown, M::Q2K) => Q3K,
            (MatrixRole::FfnDown, M::Q3KM) => {
                if layer < n_layer / 16 {
                    Q5K
                } else {
                    Q4K
                }
            }
            (MatrixRole::FfnDown, M::IQ4XS) if layer < n_layer / 8 => Q5K,
            (MatrixRole::AttnOutput, M::Q2K) => Q3K,
            (MatrixRole::AttnOutput, M::Q3KM) => Q4K,
            _ => base,
        };
        if role == MatrixRole::AttnV && class_70b && matches!(ty, Q3K | Q4K) {
            return Q5K;
        }
        ty
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third
/// one between them.
fn more_bits(layer: usize, n_layer: usize) -> bool {
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}

/// The weight types of a synthetic model: one for every matrix, or a llama.cpp mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthType {
    /// Every matrix of this type (norms and biases stay f32).
    Uniform(GgmlType),
    /// A type per matrix, as llama.cpp's file type of that name.
    Mix(QuantMix),
}

impl From<GgmlType> for SynthType {
    fn from(ty: GgmlType) -> Self {
        SynthType::Uniform(ty)
    }
}

impl From<QuantMix> for SynthType {
    fn from(mix: QuantMix) -> Self {
        SynthType::Mix(mix)
    }
}

impl SynthType {
    /// The type or mix called `name` (`q4_k`, `iq4_nl`, `q4_k_m`, `q2_k_mix`); case-insensitive.
    pub fn from_name(name: &str) -> Option<Self> {
        let lower = name.to_ascii_lowercase();
        QuantMix::ALL
            .into_iter()
            .find(|m| m.name() == lower)
            .map(SynthType::Mix)
            .or_else(|| GgmlType::from_name(&lower).map(SynthType::Uniform))
    }

    /// The type of the matrix with `role` in layer `layer` of `n_layer` (0 for the matrices
    /// outside the layers), in a model with `gqa` query heads per KV head. Whether its rows
    /// are whole blocks of that type is the caller's to check.
    pub fn type_for(self, role: MatrixRole, layer: usize, n_layer: usize, gqa: usize) -> GgmlType {
        match self {
            SynthType::Uniform(ty) => ty,
            SynthType::Mix(mix) => mix.type_for(role, layer, n_layer, gqa),
        }
    }
}

impl fmt::Display for SynthType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SynthType::Uniform(ty) => write!(f, "{ty}"),
            SynthType::Mix(mix) => f.write_str(mix.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::{IQ4XS, Q2K, Q3K, Q4K, Q5K, Q6K};

    #[test]
    fn more_bits_layers_of_a_32_layer_model() {
        let layers: Vec<usize> = (0..32).filter(|&i| more_bits(i, 32)).collect();
        assert_eq!(
            layers,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
        // Two layers: n/8 = 0, 7n/8 = 1.
        assert!(!more_bits(0, 2) && more_bits(1, 2));
    }

    #[test]
    fn names_pick_mixes_before_plain_types() {
        assert_eq!(
            SynthType::from_name("Q4_K_M"),
            Some(SynthType::Mix(QuantMix::Q4KM))
        );
        assert_eq!(SynthType::from_name("q2_k"), Some(SynthType::Uniform(Q2K)));
        assert_eq!(
            SynthType::from_name("q2_k_mix"),
            Some(SynthType::Mix(QuantMix::Q2K))
        );
        assert_eq!(
            SynthType::from_name("iq4_xs"),
            Some(SynthType::Uniform(IQ4XS))
        );
        assert_eq!(SynthType::from_name("q4_k_s"), None);
        for mix in QuantMix::ALL {
            assert_eq!(SynthType::from_name(mix.name()), Some(mix.into()));
            assert_eq!(SynthType::from(mix).to_string(), mix.name());
        }
    }

    #[test]
    fn llama3_8b_q4_k_m_types() {
        let t = |role, layer| SynthType::Mix(QuantMix::Q4KM).type_for(role, layer, 32, 4);
        assert_eq!(t(MatrixRole::Output, 0), Q6K);
        assert_eq!(t(MatrixRole::TokenEmbd, 0), Q4K);
        for (layer, more) in [(0, Q6K), (4, Q4K), (6, Q6K), (7, Q4K), (28, Q6K)] {
            assert_eq!(t(MatrixRole::AttnV, layer), more, "attn_v {layer}");
            assert_eq!(t(MatrixRole::FfnDown, layer), more, "ffn_down {layer}");
            for role in [
                MatrixRole::AttnQ,
                MatrixRole::AttnK,
                MatrixRole::AttnOutput,
                MatrixRole::FfnGate,
                MatrixRole::FfnUp,
            ] {
                assert_eq!(t(role, layer), Q4K, "{role:?} {layer}");
            }
        }
    }

    #[test]
    fn other_mixes_follow_their_rules() {
        let q3 = |role, layer| SynthType::Mix(QuantMix::Q3KM).type_for(role, layer, 32, 4);
        assert_eq!(q3(MatrixRole::AttnV, 1), Q5K);
        assert_eq!(q3(MatrixRole::AttnV, 2), Q4K);
        assert_eq!(q3(MatrixRole::FfnDown, 1), Q5K);
        assert_eq!(q3(MatrixRole::FfnDown, 2), Q4K);
        assert_eq!(q3(MatrixRole::AttnOutput, 9), Q4K);
        assert_eq!(q3(MatrixRole::FfnUp, 9), Q3K);
        let q2 = |role, gqa| SynthType::Mix(QuantMix::Q2K).type_for(role, 5, 32, gqa);
        assert_eq!(q2(MatrixRole::AttnV, 4), Q4K);
        assert_eq!(q2(MatrixRole::AttnV, 1), Q3K);
        assert_eq!(q2(MatrixRole::FfnDown, 1), Q3K);
        assert_eq!(q2(MatrixRole::AttnQ, 1), Q2K);
        let iq = |role, layer, gqa| SynthType::Mix(QuantMix::IQ4XS).type_for(role, layer, 32, gqa);
        assert_eq!(iq(MatrixRole::AttnV, 9, 4), Q5K);
        assert_eq!(iq(MatrixRole::AttnV, 9, 1), IQ4XS);
        assert_eq!(iq(MatrixRole::FfnDown, 3, 4), Q5K);
        assert_eq!(iq(MatrixRole::FfnDown, 4, 4), IQ4XS);
        assert_eq!(iq(MatrixRole::Output, 0, 4), Q6K);
        let q5 = |role, layer| SynthType::Mix(QuantMix::Q5KM).type_for(role, layer, 32, 4);
        assert_eq!(q5(MatrixRole::FfnDown, 31), Q6K);
        assert_eq!(q5(MatrixRole::FfnDown, 30 - 3), Q6K);
        assert_eq!(q5(MatrixRole::FfnDown, 26), Q5K);
        assert_eq!(
            SynthType::Uniform(Q2K).type_for(MatrixRole::Output, 0, 32, 4),
            Q2K
        );
    }

    #[test]
    fn seventy_b_models_get_q5_k_attn_v() {
        let q4 = |role, layer, gqa| SynthType::Mix(QuantMix::Q4KM).type_for(role, layer, 80, gqa);
        assert_eq!(q4(MatrixRole::AttnV, 11, 8), Q5K);
        assert_eq!(q4(MatrixRole::AttnV, 0, 8), Q6K, "more bits wins");
        assert_eq!(
            q4(MatrixRole::AttnV, 11, 1),
            Q4K,
            "65B: no grouped KV heads"
        );
        assert_eq!(q4(MatrixRole::AttnQ, 11, 8), Q4K);
        let q2 = SynthType::Mix(QuantMix::Q2K).type_for(MatrixRole::AttnV, 11, 80, 8);
        assert_eq!(q2, Q5K);
    }
}
