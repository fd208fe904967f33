//! The shapes the synthesizer writes: each real model's hyper-parameters, and tiny ones
//! for tests.

use super::moe;

/// The shape of a synthetic model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthShape {
    /// A 2-layer llama small enough for unit tests (every quant type fits its rows).
    Tiny,
    /// A 2-layer qwen2 (biases, NEOX rope, tied output) as small as `Tiny`.
    TinyQwen2,
    /// Llama 3.2 1B.
    Llama3_1b,
    /// Llama 3.1 8B.
    Llama3_8b,
    /// Llama 3.1 70B.
    Llama3_70b,
    /// Llama 2 7B.
    Llama2_7b,
    /// Qwen2 0.5B.
    Qwen2_0_5b,
    /// Qwen2.5 14B.
    Qwen2_5_14b,
    /// A 2-layer qwen3 (q/k norms, heads of 128 wider than `n_embd / n_head`, tied output)
    /// as small as `Tiny`.
    TinyQwen3,
    /// Qwen3 8B.
    Qwen3_8b,
    /// A 6-layer gemma3 (five sliding-window layers of 8 positions, then a global one) as
    /// small as `Tiny`.
    TinyGemma3,
    /// Gemma 3 12B (text).
    Gemma3_12b,
    /// A 2-layer phi3 (fused q/k/v and gate/up) as small as `Tiny`.
    TinyPhi3,
    /// Phi-3 mini (4k context).
    Phi3Mini,
    /// `TinyQwen3` with Qwen3's long-context YaRN (factor 4 over 32768 positions).
    TinyQwen3Yarn,
    /// A 4-layer gemma2 (sliding-window layers of 8 positions alternating with global ones;
    /// soft-caps of 2 on the attention scores and 1 on the logits, small enough to bend
    /// this model's values, where Gemma 2's own 50 and 30 would barely touch them).
    TinyGemma2,
    /// A 2-layer qwen3moe of 8 experts, 2 used a token, as small as `TinyQwen3`.
    TinyQwen3Moe,
    /// A 2-layer Mixtral-style llama of 8 experts, 2 used a token.
    TinyMixtral,
    /// Qwen3-30B-A3B: 48 layers of 128 experts, 8 used a token.
    Qwen3_30bA3b,
    /// Mixtral 8x7B: 32 layers of 8 experts, 2 used a token.
    Mixtral8x7b,
}

/// Hyper-parameters of a shape.
pub(super) struct Dims {
    pub(super) arch: &'static str,
    pub(super) n_embd: usize,
    pub(super) n_layer: usize,
    pub(super) n_head: usize,
    pub(super) n_head_kv: usize,
    pub(super) n_ff: usize,
    pub(super) n_vocab: usize,
    pub(super) rope_base: f32,
    pub(super) ctx: u32,
    pub(super) tied: bool,
    /// llama3-style `rope_freqs.weight`.
    pub(super) rope_freqs: bool,
    pub(super) bias: bool,
    /// Elements per head when not `n_embd / n_head` (written as `attention.key_length`).
    pub(super) head_dim: Option<usize>,
    /// Qwen3's per-head `attn_q_norm` and `attn_k_norm`.
    pub(super) qk_norm: bool,
    /// Gemma's `post_attention_norm` and `post_ffw_norm`.
    pub(super) post_norms: bool,
    /// `attention.sliding_window`, written when set.
    pub(super) window: Option<usize>,
    /// Linear `rope.scaling.factor`, written when set.
    pub(super) rope_linear: Option<f32>,
    /// YaRN `rope.scaling.factor` and `original_context_length`, written when set.
    pub(super) yarn: Option<(f32, usize)>,
    /// `attn_logit_softcapping` and `final_logit_softcapping`, written when set.
    pub(super) softcaps: Option<(f32, f32)>,
    /// Phi-3's fused `attn_qkv` and gate-and-up `ffn_up`.
    pub(super) fused: bool,
    /// `attention.layer_norm_rms_epsilon`.
    pub(super) eps: f32,
    /// Mixture-of-experts feed-forward instead of the dense one.
    pub(super) moe: Option<moe::Experts>,
}

impl SynthShape {
    /// Every shape.
    pub const ALL: [SynthShape; 20] = [
        SynthShape::Tiny,
        SynthShape::TinyQwen2,
        SynthShape::Llama3_1b,
        SynthShape::Llama3_8b,
        SynthShape::Llama3_70b,
        SynthShape::Llama2_7b,
        SynthShape::Qwen2_0_5b,
        SynthShape::Qwen2_5_14b,
        SynthShape::TinyQwen3,
        SynthShape::Qwen3_8b,
        SynthShape::TinyGemma3,
        SynthShape::Gemma3_12b,
        SynthShape::TinyPhi3,
        SynthShape::Phi3Mini,
        SynthShape::TinyQwen3Yarn,
        SynthShape::TinyGemma2,
        SynthShape::TinyQwen3Moe,
        SynthShape::TinyMixtral,
        SynthShape::Qwen3_30bA3b,
        SynthShape::Mixtral8x7b,
    ];

    /// The command-line name (`tiny`, `llama3-8b`, `qwen2.5-14b`).
    pub fn name(self) -> &'static str {
        match self {
            SynthShape::Tiny => "tiny",
            SynthShape::TinyQwen2 => "tiny-qwen2",
            SynthShape::Llama3_1b => "llama3-1b",
            SynthShape::Llama3_8b => "llama3-8b",
            SynthShape::Llama3_70b => "llama3-70b",
            SynthShape::Llama2_7b => "llama2-7b",
            SynthShape::Qwen2_0_5b => "qwen2-0.5b",
            SynthShape::Qwen2_5_14b => "qwen2.5-14b",
            SynthShape::TinyQwen3 => "tiny-qwen3",
            SynthShape::Qwen3_8b => "qwen3-8b",
            SynthShape::TinyGemma3 => "tiny-gemma3",
            SynthShape::Gemma3_12b => "gemma3-12b",
            SynthShape::TinyPhi3 => "tiny-phi3",
            SynthShape::Phi3Mini => "phi3-mini",
            SynthShape::TinyQwen3Yarn => "tiny-qwen3-yarn",
            SynthShape::TinyGemma2 => "tiny-gemma2",
            SynthShape::TinyQwen3Moe => "tiny-qwen3moe",
            SynthShape::TinyMixtral => "tiny-mixtral",
            SynthShape::Qwen3_30bA3b => "qwen3-30b-a3b",
            SynthShape::Mixtral8x7b => "mixtral-8x7b",
        }
    }

    /// The shape called `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.name() == name)
    }

    pub(super) fn dims(self) -> Dims {
        let llama = |n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, rope_base, tied| Dims {
            arch: "llama",
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            n_ff,
            n_vocab,
            rope_base,
            ctx: 8192,
            tied,
            bias: false,
            rope_freqs: false,
            head_dim: None,
            qk_norm: false,
            post_norms: false,
            window: None,
            rope_linear: None,
            yarn: None,
            softcaps: None,
            fused: false,
            eps: 1e-5,
            moe: None,
        };
        let qwen = |n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, tied| Dims {
            arch: "qwen2",
            bias: true,
            ..llama(n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, 1e6, tied)
        };
        let qwen3 = |n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, tied| Dims {
            arch: "qwen3",
            bias: false,
            qk_norm: true,
            head_dim: Some(head_dim),
            ctx: 40960,
            ..qwen(n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, tied)
        };
        // Gemma 3's text model as llama.cpp converts it: heads of key_length, tied output,
        // global layers with base 1e6 and linear scaling 8, eps 1e-6.
        let gemma3 = |n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_vocab, window| Dims {
            arch: "gemma3",
            qk_norm: true,
            post_norms: true,
            head_dim: Some(head_dim),
            window: Some(window),
            rope_linear: Some(8.0),
            ctx: 131072,
            eps: 1e-6,
            ..llama(n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, 1e6, true)
        };
        let phi3 = |n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab| Dims {
            arch: "phi3",
            fused: true,
            ctx: 4096,
            ..llama(
                n_embd, n_layer, n_head, n_head_kv, n_ff, n_vocab, 10000.0, false,
            )
        };
        match self {
            SynthShape::TinyGemma3 => gemma3(256, 6, 4, 2, 64, 512, 320, 8),
            SynthShape::Gemma3_12b => gemma3(3840, 48, 16, 8, 256, 15360, 262_144, 1024),
            SynthShape::TinyPhi3 => phi3(256, 2, 4, 2, 512, 320),
            SynthShape::Phi3Mini => phi3(3072, 32, 32, 32, 8192, 32064),
            SynthShape::Tiny => Dims {
                rope_freqs: true,
                ..llama(256, 2, 4, 2, 512, 320, 10000.0, false)
            },
            SynthShape::TinyQwen2 => qwen(256, 2, 4, 2, 512, 320, true),
            SynthShape::Llama3_1b => Dims {
                rope_freqs: true,
                ..llama(2048, 16, 32, 8, 8192, 128256, 500000.0, true)
            },
            SynthShape::Llama3_8b => Dims {
                rope_freqs: true,
                ..llama(4096, 32, 32, 8, 14336, 128256, 500000.0, false)
            },
            SynthShape::Llama3_70b => Dims {
                rope_freqs: true,
                ctx: 131072,
                ..llama(8192, 80, 64, 8, 28672, 128256, 500000.0, false)
            },
            SynthShape::Llama2_7b => llama(4096, 32, 32, 32, 11008, 32000, 10000.0, false),
            SynthShape::Qwen2_0_5b => qwen(896, 24, 14, 2, 4864, 151936, true),
            SynthShape::Qwen2_5_14b => qwen(5120, 48, 40, 8, 13824, 152064, false),
            // Heads of 128 where n_embd / n_head is 64, as Qwen3 0.6B (1024 wide, 16 heads).
            SynthShape::TinyQwen3 => qwen3(256, 2, 4, 2, 128, 512, 320, true),
            SynthShape::TinyGemma2 => Dims {
                arch: "gemma2",
                qk_norm: false,
                rope_linear: None,
                rope_base: 10000.0,
                softcaps: Some((2.0, 1.0)),
                ..gemma3(256, 4, 4, 2, 64, 512, 320, 8)
            },
            SynthShape::TinyQwen3Yarn => Dims {
                yarn: Some((4.0, 32768)),
                ..qwen3(256, 2, 4, 2, 128, 512, 320, true)
            },
            SynthShape::Qwen3_8b => qwen3(4096, 36, 32, 8, 128, 12288, 151936, false),
            SynthShape::TinyQwen3Moe => Dims {
                arch: "qwen3moe",
                moe: Some(moe::Experts::new(8, 2, 256)),
                ..qwen3(256, 2, 4, 2, 64, 384, 320, true)
            },
            SynthShape::TinyMixtral => Dims {
                moe: Some(moe::Experts::new(8, 2, 256)),
                ..llama(256, 2, 4, 2, 256, 320, 1e6, false)
            },
            // Its feed_forward_length (6144) sizes no tensor: every layer is experts.
            SynthShape::Qwen3_30bA3b => Dims {
                arch: "qwen3moe",
                eps: 1e-6,
                moe: Some(moe::Experts::new(128, 8, 768)),
                ..qwen3(2048, 48, 32, 4, 128, 6144, 151936, false)
            },
            SynthShape::Mixtral8x7b => Dims {
                ctx: 32768,
                moe: Some(moe::Experts::new(8, 2, 14336)),
                ..llama(4096, 32, 32, 8, 14336, 32000, 1e6, false)
            },
        }
    }
}
