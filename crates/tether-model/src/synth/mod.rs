//! Synthetic models: GGUF files with random weights in the exact shape of real models, for
//! tests and benchmarks without downloading anything.

mod blocks;
mod extra;
mod mix;
mod moe;
mod shape;
mod vocab;

use std::path::Path;

use tether_gguf::{GgmlType, GgufWriter, MetaValue};

use crate::arch::{POST_ATTN_NORM, POST_FFW_NORM};
use crate::error::ModelError;
use blocks::{FastRng, fill_random};
pub use mix::{MatrixRole, QuantMix, SynthType};
pub use shape::SynthShape;

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
