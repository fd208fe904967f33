//! Synthetic models: GGUF files with random weights in the exact shape of real models, for
//! tests and benchmarks without downloading anything.

mod blocks;
mod extra;
mod mix;
mod moe;
mod vocab;

use std::path::Path;

use tether_gguf::{GgmlType, GgufWriter, MetaValue};

use crate::arch::{POST_ATTN_NORM, POST_FFW_NORM};
use crate::error::ModelError;
use blocks::{FastRng, fill_random};
pub use mix::{MatrixRole, QuantMix, SynthType};

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
struct Dims {
    arch: &'static str,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    n_ff: usize,
    n_vocab: usize,
    rope_base: f32,
    ctx: u32,
    tied: bool,
    /// llama3-style `rope_freqs.weight`.
    rope_freqs: bool,
    bias: bool,
    /// Elements per head when not `n_embd / n_head` (written as `attention.key_length`).
    head_dim: Option<usize>,
    /// Qwen3's per-head `attn_q_norm` and `attn_k_norm`.
    qk_norm: bool,
    /// Gemma's `post_attention_norm` and `post_ffw_norm`.
    post_norms: bool,
    /// `attention.sliding_window`, written when set.
    window: Option<usize>,
    /// Linear `rope.scaling.factor`, written when set.
    rope_linear: Option<f32>,
    /// YaRN `rope.scaling.factor` and `original_context_length`, written when set.
    yarn: Option<(f32, usize)>,
    /// `attn_logit_softcapping` and `final_logit_softcapping`, written when set.
    softcaps: Option<(f32, f32)>,
    /// Phi-3's fused `attn_qkv` and gate-and-up `ffn_up`.
    fused: bool,
    /// `attention.layer_norm_rms_epsilon`.
    eps: f32,
    /// Mixture-of-experts feed-forward instead of the dense one.
    moe: Option<moe::Experts>,
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

    fn dims(self) -> Dims {
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

/// The type a `cols`-wide matrix gets when `ty`'s blocks do not divide its rows
/// (llama.cpp's quantizer falls back the same way; its newer versions send q2_k and q3_k to
/// iq4_nl rather than q4_0).
fn fit_type(ty: GgmlType, cols: usize) -> GgmlType {
    if cols.is_multiple_of(ty.block_elems()) {
        return ty;
    }
    let fallback = match ty {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::IQ4XS => GgmlType::IQ4NL,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        _ => GgmlType::Q8_0,
    };
    if cols.is_multiple_of(fallback.block_elems()) {
        fallback
    } else {
        GgmlType::F16
    }
}

/// Adds a tensor whose random data is generated while the file is written.
fn add_random(
    w: &mut GgufWriter,
    name: String,
    ty: GgmlType,
    dims: &[usize],
    amp: f32,
    seed: u64,
) -> Result<(), ModelError> {
    let dims64: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    let elems: u64 = dims64.iter().product();
    let total = ty.bytes_for(elems).ok_or_else(|| {
        ModelError::Config(format!(
            "tensor '{name}': {dims:?} is not whole {ty} blocks"
        ))
    })?;
    // Whole rows per chunk keep every chunk whole blocks.
    let row_bytes = ty.bytes_for(dims64[0]).unwrap_or(total).max(1);
    let chunk = ((8u64 << 20) / row_bytes).max(1) * row_bytes;
    let stream = Box::new(move |out: &mut dyn std::io::Write| {
        let mut rng = FastRng::new(seed);
        let mut buf = vec![0u8; chunk.min(total) as usize];
        let mut left = total;
        while left > 0 {
            let n = left.min(chunk) as usize;
            fill_random(ty, amp, &mut rng, &mut buf[..n]);
            out.write_all(&buf[..n])?;
            left -= n as u64;
        }
        Ok(())
    });
    w.add_tensor_stream(name, ty, &dims64, stream)?;
    Ok(())
}

/// Adds an f32 vector of values `center ± spread`.
fn add_vector(
    w: &mut GgufWriter,
    name: String,
    n: usize,
    center: f32,
    spread: f32,
    rng: &mut FastRng,
) -> Result<(), ModelError> {
    let data: Vec<u8> = (0..n)
        .flat_map(|_| (center + spread * rng.signed_unit()).to_le_bytes())
        .collect();
    w.add_tensor(name, GgmlType::F32, &[n as u64], data)?;
    Ok(())
}

/// Writes a GGUF file at `path` with random weights of `shape`; matrices are of the type
/// `ty` gives them (one [`GgmlType`] for all, or a [`QuantMix`]; a fallback where its
/// blocks do not fit a row), norms and biases f32. The same seed gives the same file.
pub fn synthesize(
    path: impl AsRef<Path>,
    shape: SynthShape,
    ty: impl Into<SynthType>,
    seed: u64,
) -> Result<(), ModelError> {
    let w = build(shape, ty.into(), seed)?;
    w.write_file(path.as_ref())?;
    Ok(())
}

/// [`synthesize`] with more metadata keys after the shape's own (a
/// `tokenizer.chat_template`, ...).
pub fn synthesize_with(
    path: impl AsRef<Path>,
    shape: SynthShape,
    ty: impl Into<SynthType>,
    seed: u64,
    extra: Vec<(String, MetaValue)>,
) -> Result<(), ModelError> {
    let mut w = build(shape, ty.into(), seed)?;
    for (key, value) in extra {
        w.add_metadata(key, value);
    }
    w.write_file(path.as_ref())?;
    Ok(())
}

/// The file `synthesize` writes, with every matrix's random data still to be generated.
fn build(shape: SynthShape, ty: SynthType, seed: u64) -> Result<GgufWriter, ModelError> {
    if let SynthType::Uniform(t @ (GgmlType::Q8_1 | GgmlType::Q8K)) = ty {
        return Err(ModelError::Config(format!(
            "{t} is not a weight type; pick f16, q8_0, q4_k, q4_k_m, ..."
        )));
    }
    let d = shape.dims();
    let mut w = GgufWriter::new();
    let key = |k: &str| format!("{}.{k}", d.arch);
    w.add_metadata("general.architecture", MetaValue::String(d.arch.into()));
    w.add_metadata(
        "general.name",
        MetaValue::String(format!(
            "synthetic {} {} (random weights, seed {seed})",
            shape.name(),
            ty
        )),
    );
    let u32v = |n: usize| MetaValue::U32(n as u32);
    w.add_metadata(key("context_length"), MetaValue::U32(d.ctx));
    w.add_metadata(key("embedding_length"), u32v(d.n_embd));
    w.add_metadata(key("block_count"), u32v(d.n_layer));
    w.add_metadata(key("feed_forward_length"), u32v(d.n_ff));
    w.add_metadata(key("attention.head_count"), u32v(d.n_head));
    w.add_metadata(key("attention.head_count_kv"), u32v(d.n_head_kv));
    w.add_metadata(
        key("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(d.eps),
    );
    if let Some(window) = d.window {
        w.add_metadata(key("attention.sliding_window"), u32v(window));
    }
    if let Some((attn, last)) = d.softcaps {
        w.add_metadata(key("attn_logit_softcapping"), MetaValue::F32(attn));
        w.add_metadata(key("final_logit_softcapping"), MetaValue::F32(last));
    }
    if let Some((factor, orig)) = d.yarn {
        w.add_metadata(key("rope.scaling.type"), MetaValue::String("yarn".into()));
        w.add_metadata(key("rope.scaling.factor"), MetaValue::F32(factor));
        w.add_metadata(key("rope.scaling.original_context_length"), u32v(orig));
    }
    if let Some(factor) = d.rope_linear {
        w.add_metadata(key("rope.scaling.type"), MetaValue::String("linear".into()));
        w.add_metadata(key("rope.scaling.factor"), MetaValue::F32(factor));
    }
    if let Some(experts) = &d.moe {
        experts.add_metadata(&mut w, d.arch);
    }
    w.add_metadata(key("rope.freq_base"), MetaValue::F32(d.rope_base));
    let head_dim = d.head_dim.unwrap_or(d.n_embd / d.n_head);
    if d.head_dim.is_some() {
        w.add_metadata(key("attention.key_length"), u32v(head_dim));
        w.add_metadata(key("attention.value_length"), u32v(head_dim));
    }
    w.add_metadata(key("rope.dimension_count"), u32v(head_dim));
    vocab::add_tokenizer(&mut w, d.n_vocab);

    let (e, q, kv, ff) = (
        d.n_embd,
        d.n_head * head_dim,
        d.n_head_kv * head_dim,
        d.n_ff,
    );
    let gqa = d.n_head / d.n_head_kv;
    // The type of a matrix with `cols`-element rows.
    let pick = |role, layer, cols| fit_type(ty.type_for(role, layer, d.n_layer, gqa), cols);
    let embd_role = if d.tied {
        MatrixRole::Output
    } else {
        MatrixRole::TokenEmbd
    };
    let mut rng = FastRng::new(seed);
    let mut next_seed = || rng.next_u64();
    let mut vec_rng = FastRng::new(seed ^ 0x5eed);
    // Uniform(±amp) has standard deviation amp/√3; ±√(3/cols) keeps each output near unit size.
    let amp = |cols: usize| (3.0 / cols as f32).sqrt();
    // Gemma multiplies embeddings by sqrt(n_embd): rows of that much smaller values keep
    // the residual stream near the size of the layers' outputs (as in the real models),
    // else it echoes its input token forever.
    let scaled = crate::Arch::from_name(d.arch).is_some_and(|a| a.traits().scaled_embedding);
    let embd_amp = if scaled { 1.0 / (e as f32).sqrt() } else { 1.0 };
    add_random(
        &mut w,
        "token_embd.weight".into(),
        pick(embd_role, 0, e),
        &[e, d.n_vocab],
        embd_amp,
        next_seed(),
    )?;
    for l in 0..d.n_layer {
        let n = |s: &str| format!("blk.{l}.{s}");
        add_vector(&mut w, n("attn_norm.weight"), e, 1.0, 0.1, &mut vec_rng)?;
        if d.fused {
            let seeds = [next_seed(), next_seed(), next_seed(), next_seed()];
            extra::add_fused_layer(&mut w, l, (e, q, kv, ff), &pick, seeds)?;
            add_vector(&mut w, n("ffn_norm.weight"), e, 1.0, 0.1, &mut vec_rng)?;
            continue;
        }
        add_random(
            &mut w,
            n("attn_q.weight"),
            pick(MatrixRole::AttnQ, l, e),
            &[e, q],
            amp(e),
            next_seed(),
        )?;
        add_random(
            &mut w,
            n("attn_k.weight"),
            pick(MatrixRole::AttnK, l, e),
            &[e, kv],
            amp(e),
            next_seed(),
        )?;
        add_random(
            &mut w,
            n("attn_v.weight"),
            pick(MatrixRole::AttnV, l, e),
            &[e, kv],
            amp(e),
            next_seed(),
        )?;
        if d.bias {
            add_vector(&mut w, n("attn_q.bias"), q, 0.0, 0.1, &mut vec_rng)?;
            add_vector(&mut w, n("attn_k.bias"), kv, 0.0, 0.1, &mut vec_rng)?;
            add_vector(&mut w, n("attn_v.bias"), kv, 0.0, 0.1, &mut vec_rng)?;
        }
        if d.qk_norm {
            add_vector(
                &mut w,
                n("attn_q_norm.weight"),
                head_dim,
                1.0,
                0.3,
                &mut vec_rng,
            )?;
            add_vector(
                &mut w,
                n("attn_k_norm.weight"),
                head_dim,
                1.0,
                0.3,
                &mut vec_rng,
            )?;
        }
        add_random(
            &mut w,
            n("attn_output.weight"),
            pick(MatrixRole::AttnOutput, l, q),
            &[q, e],
            amp(q),
            next_seed(),
        )?;
        if d.post_norms {
            add_vector(&mut w, n(POST_ATTN_NORM), e, 1.0, 0.1, &mut vec_rng)?;
        }
        add_vector(&mut w, n("ffn_norm.weight"), e, 1.0, 0.1, &mut vec_rng)?;
        if let Some(experts) = &d.moe {
            let pick = |role, cols| pick(role, l, cols);
            experts.add_layer(&mut w, l, e, pick, &mut next_seed)?;
            continue;
        }
        add_random(
            &mut w,
            n("ffn_gate.weight"),
            pick(MatrixRole::FfnGate, l, e),
            &[e, ff],
            amp(e),
            next_seed(),
        )?;
        add_random(
            &mut w,
            n("ffn_up.weight"),
            pick(MatrixRole::FfnUp, l, e),
            &[e, ff],
            amp(e),
            next_seed(),
        )?;
        add_random(
            &mut w,
            n("ffn_down.weight"),
            pick(MatrixRole::FfnDown, l, ff),
            &[ff, e],
            amp(ff),
            next_seed(),
        )?;
        if d.post_norms {
            add_vector(&mut w, n(POST_FFW_NORM), e, 1.0, 0.1, &mut vec_rng)?;
        }
    }
    if d.rope_freqs {
        // llama3's shape of factors: 1 for the fast-turning pairs, rising to 8 for the slow ones.
        let half = head_dim / 2;
        let data: Vec<u8> = (0..half)
            .map(|i| 1.0 + 7.0 * (2.0 * i as f32 / half as f32 - 1.0).max(0.0))
            .flat_map(f32::to_le_bytes)
            .collect();
        w.add_tensor("rope_freqs.weight", GgmlType::F32, &[half as u64], data)?;
    }
    add_vector(
        &mut w,
        "output_norm.weight".into(),
        e,
        1.0,
        0.1,
        &mut vec_rng,
    )?;
    if !d.tied {
        // Larger than unit size so logits spread out and greedy choices are clear.
        add_random(
            &mut w,
            "output.weight".into(),
            pick(MatrixRole::Output, 0, e),
            &[e, d.n_vocab],
            4.0 * amp(e),
            next_seed(),
        )?;
    }
    Ok(w)
}

#[cfg(test)]
mod tests;
