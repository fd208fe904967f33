//! Logits and greedy tokens from `Stage` on the cpu backend against the f64 reference.

use tether_gguf::{GgmlType, GgufFile};
use tether_model::synth::QuantMix;
use tether_model::{Generator, Sampler, SamplingParams, SynthShape};

use crate::reference_model::{Reference, relative_error};
use crate::support::{backend, synth};

/// Checks per-position relative error below `tol`, then `n_greedy` greedy tokens.
///
/// With `max_near_ties == 0` the tokens must equal the reference's own greedy run. Otherwise
/// the reference is run on our tokens and each must be its argmax, except where our token's
/// reference logit is within three times the largest logit error measured above of the
/// maximum (a near-tie the measured error can flip); at most `max_near_ties` of those.
fn compare(
    file: &GgufFile,
    tokens: &[u32],
    tol: f64,
    prompt: &[u32],
    n_greedy: usize,
    max_near_ties: usize,
    what: &str,
) {
    let reference = Reference::load(file);
    let mut generator = Generator::from_file(backend(), file, 128, 5).unwrap();
    let ours = generator.eval_logits(tokens).unwrap();
    let theirs = reference.logits(tokens);
    let v = reference.vocab();
    let mut worst = 0f64;
    let mut worst_abs = 0f64;
    for (pos, want) in theirs.iter().enumerate() {
        let got = &ours[pos * v..(pos + 1) * v];
        let err = relative_error(got, want);
        assert!(
            err < tol,
            "{what}: position {pos}: relative error {err:e} >= {tol:e}"
        );
        worst = worst.max(err);
        let abs = got
            .iter()
            .zip(want)
            .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()));
        worst_abs = worst_abs.max(abs);
    }
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let (got, _) = generator
        .generate(prompt, n_greedy, &mut sampler, &[], |_| true)
        .unwrap();
    assert_eq!(got.len(), n_greedy);
    if max_near_ties == 0 {
        assert_eq!(
            got,
            reference.greedy(prompt, n_greedy),
            "{what}: greedy tokens"
        );
        println!("{what}: worst relative error {worst:.2e}, greedy equal");
        return;
    }
    let ties = reference.check_greedy(prompt, &got, worst_abs, max_near_ties, what);
    println!("{what}: worst relative error {worst:.2e}, {ties} near-ties");
}

#[test]
fn stories260k_matches_reference() {
    let Some(stories) = tether_test_data::stories260k() else {
        return;
    };
    let file = GgufFile::open(stories).unwrap();
    let tokens = [1, 403, 261, 353, 6, 44, 290, 18, 409, 31, 511, 2];
    compare(&file, &tokens, 1e-4, &[1], 32, 0, "stories260K");
}

/// A tiny model of `shape` in every weight type (seeds from `seed`) against the reference.
fn every_type_matches(shape: SynthShape, seed: u64, label: &str) {
    every_type_within(shape, seed, label, 2e-2, 2e-2);
}

/// As `every_type_matches`, float weight types within `float_tol` and quantized ones within
/// `quant_tol` (their products quantize activations to 8 bits, the error the reference
/// does not make).
fn every_type_within(shape: SynthShape, seed: u64, label: &str, float_tol: f64, quant_tol: f64) {
    for (i, ty) in GgmlType::WEIGHTS.into_iter().enumerate() {
        let m = synth(shape, ty, seed + i as u64);
        let ties = if ty.is_quantized() { 2 } else { 0 };
        compare(
            &m.file,
            &tiny_tokens(),
            if ty.is_quantized() {
                quant_tol
            } else {
                float_tol
            },
            &[1, 300],
            16,
            ties,
            &format!("{label} {ty}"),
        );
    }
}

fn tiny_tokens() -> Vec<u32> {
    vec![1, 300, 17, 260, 45, 299, 3, 270, 288, 100, 311, 5, 261]
}

#[test]
fn tiny_llama_of_every_type_matches_reference() {
    every_type_matches(SynthShape::Tiny, 10, "tiny");
}

#[test]
fn tiny_qwen2_of_every_type_matches_reference() {
    every_type_matches(SynthShape::TinyQwen2, 40, "tiny-qwen2");
}

#[test]
fn tiny_qwen3_of_every_type_matches_reference() {
    every_type_matches(SynthShape::TinyQwen3, 90, "tiny-qwen3");
}

/// Gemma 3: 13-token prompts and 16 greedy tokens run past the 8-position window of the
/// five sliding layers, so the window, the two rope bases and the global layer all count.
/// The float weight types are the check of the architecture (measured up to 2e-4). With
/// quantized types the cpu products quantize activations to 8 bits, an error the reference
/// does not make; Gemma normalizes each layer's output before it joins the residual stream,
/// so that error reaches the logits undiluted, over six layers rather than two: measured
/// 2e-2 to 8e-2 (q4_k, q5_k, q6_k, q8_0) over three seeds, 2e-3 for q4_0 (whose prompt
/// products keep f32 activations).
#[test]
fn tiny_gemma3_of_every_type_matches_reference() {
    every_type_within(SynthShape::TinyGemma3, 130, "tiny-gemma3", 1e-3, 1e-1);
}

/// YaRN of Qwen3's long context (factor 4 over 32768): the ramp runs over pairs 23..40 of
/// the 64, so interpolated, extrapolated and blended pairs all count.
#[test]
fn tiny_qwen3_with_yarn_matches_reference() {
    every_type_within(
        SynthShape::TinyQwen3Yarn,
        190,
        "tiny-qwen3-yarn",
        1e-3,
        2e-2,
    );
}

/// Gemma 2: alternating sliding and global layers, both soft-caps. Quantized types as
/// Gemma 3's (same normalized residual; measured up to 3.7e-2 here).
#[test]
fn tiny_gemma2_of_every_type_matches_reference() {
    every_type_within(SynthShape::TinyGemma2, 220, "tiny-gemma2", 1e-3, 1e-1);
}

#[test]
fn tiny_phi3_of_every_type_matches_reference() {
    every_type_within(SynthShape::TinyPhi3, 160, "tiny-phi3", 1e-3, 3e-2);
}

/// llama.cpp's per-tensor mixes (q6_k output, more bits on some attn_v and ffn_down) on the
/// cpu backend; tiny-qwen2 ties its output to token_embd, which then takes q6_k. The
/// tolerance is above the single types' 2e-2: each mix chains several kernels that quantize
/// activations to 8 bits, and their noise adds (q4_k_m and q5_k_m measured 2.2e-2 and 2.5e-2).
#[test]
fn tiny_models_of_every_quant_mix_match_reference() {
    for (i, mix) in QuantMix::ALL.into_iter().enumerate() {
        for (shape, seed) in [
            (SynthShape::Tiny, 70),
            (SynthShape::TinyQwen2, 80),
            (SynthShape::TinyQwen3, 110),
        ] {
            let m = synth(shape, mix, seed + i as u64);
            compare(
                &m.file,
                &tiny_tokens(),
                3e-2,
                &[1, 300],
                16,
                2,
                &format!("{} {}", shape.name(), mix.name()),
            );
        }
    }
}

/// Mixture-of-experts models in f32: the routing, the chosen experts and their weighted
/// sum agree with the reference's float64 within 1e-3, and greedy tokens are equal.
#[test]
fn tiny_moe_models_in_f32_match_reference() {
    for (shape, seed) in [
        (SynthShape::TinyQwen3Moe, 130),
        (SynthShape::TinyMixtral, 140),
    ] {
        let m = synth(shape, GgmlType::F32, seed);
        compare(
            &m.file,
            &tiny_tokens(),
            1e-3,
            &[1, 300],
            16,
            0,
            &format!("{} f32", shape.name()),
        );
    }
}

/// The MoE shapes in every type: float types within 1e-3 (measured up to 5e-5), quantized
/// ones within 4e-2 rather than the dense models' 2e-2: kernels that quantize activations
/// to 8 bits move the router's scores too, so the experts' weights carry that noise on top
/// of the products' (typical positions measure 1e-2 to 1.7e-2 as dense models do; single
/// positions of q8_0 and q4_k 2.6e-2 and 3.2e-2).
#[test]
fn tiny_qwen3moe_of_every_type_matches_reference() {
    every_type_within(SynthShape::TinyQwen3Moe, 150, "tiny-qwen3moe", 1e-3, 4e-2);
}

#[test]
fn tiny_mixtral_of_every_type_matches_reference() {
    every_type_within(SynthShape::TinyMixtral, 170, "tiny-mixtral", 1e-3, 4e-2);
}
