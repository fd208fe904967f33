//! Whole models on the cuda backend against an independent float64 reference (and the cpu
//! backend beside it): logits of every position within 1e-2 relative error and 64 greedy
//! tokens, on synthesized tiny models of every weight type the cuda backend reads and on
//! stories260K; quantized KV caches against the cpu's.
//!
//! Ignored by default (CI has no GPU); on a GPU machine run with `--ignored`. Without a GPU
//! these tests fail: asked to check the GPU, they must not pass by skipping it.

use std::path::PathBuf;
use std::sync::Arc;

use tether_compute::{Backend, CpuBackend, CudaBackend, CudaTuning};
use tether_gguf::{GgmlType, GgufFile};
use tether_model::{
    BatchToken, Generator, ModelConfig, Sampler, SamplingParams, StageSpec, StepInput, StepOutput,
    SynthShape, load_stage_from_file, synthesize,
};

#[path = "forward/reference_model.rs"]
mod reference_model;
use reference_model::{Reference, relative_error};

/// 40 tokens: more than one 16-token micro-batch, and more than the matvec kernels' 8
/// tokens per launch, so the prefill paths run too.
fn prompt(n_vocab: usize) -> Vec<u32> {
    (0..40u32)
        .map(|i| (i * 7919 + 13) % n_vocab as u32)
        .collect()
}

const CTX: usize = 128;
const UBATCH: usize = 16;
const GREEDY_STEPS: usize = 64;

fn gpu() -> Arc<CudaBackend> {
    Arc::new(
        CudaBackend::with_tuning(0, &CudaTuning::from_env())
            .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}")),
    )
}

fn cpu() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(None).unwrap())
}

/// Worst over rows of `‖a − b‖ / ‖b‖` (the relative error of each position's logits).
fn worst_row_error(a: &[f32], b: &[f32], n_vocab: usize) -> f32 {
    a.chunks(n_vocab)
        .zip(b.chunks(n_vocab))
        .map(|(ra, rb)| {
            let d: f64 = ra
                .iter()
                .zip(rb)
                .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
                .sum();
            let n: f64 = rb.iter().map(|y| f64::from(*y).powi(2)).sum();
            (d / n.max(1e-30)).sqrt() as f32
        })
        .fold(0f32, f32::max)
}

fn greedy<B: Backend>(g: &mut Generator<B>, prompt: &[u32]) -> Vec<u32> {
    let mut sampler = Sampler::new(SamplingParams::greedy());
    // No end-of-generation tokens: always GREEDY_STEPS tokens.
    g.generate(prompt, GREEDY_STEPS, &mut sampler, &[], |_| true)
        .unwrap()
        .0
}

/// The cuda backend against the float64 reference on `file` (f16 KV cache): every
/// position's logits within 1e-2, the last-token prefill too, and 64 greedy tokens that are
/// each the reference's choice or a near-tie (within three times the largest logit error);
/// exactly the reference's tokens when the weights are exact floats. The cpu backend's
/// distance to the reference is printed beside it quantizes activations to 8 bits for
/// quantized weights (as llama.cpp does), which costs it up to 2e-2 on these models.
///
/// With `eight_bit` (Q4_0, Q8_0 and K-quant weights, whose decode products take 8-bit
/// activations on both backends, as llama.cpp's do) the bound is the cpu's own distance to
/// the reference times 1.5, when that is above 1e-2: the cuda backend must be no worse than
/// the cpu; and up to 8 of the 64 greedy tokens may be near-ties instead of 3.
fn check_against_reference(file: &GgufFile, what: &str, eight_bit: bool) {
    let reference = Reference::load(file);
    let v = reference.vocab();
    let tokens = prompt(v);
    let want = reference.logits(&tokens);
    let load = Generator::from_file(gpu(), file, CTX, UBATCH);
    let mut on_gpu = load.unwrap_or_else(|e| panic!("{what}: loading on the GPU: {e}"));
    let got = on_gpu.eval_logits(&tokens).unwrap();
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite logits"
    );
    let mut on_cpu = Generator::from_file(cpu(), file, CTX, UBATCH).unwrap();
    let cpu_logits = on_cpu.eval_logits(&tokens).unwrap();
    let (mut worst, mut worst_abs, mut cpu_worst) = (0f64, 0f64, 0f64);
    for (pos, row) in want.iter().enumerate() {
        let g = &got[pos * v..(pos + 1) * v];
        worst = worst.max(relative_error(g, row));
        cpu_worst = cpu_worst.max(relative_error(&cpu_logits[pos * v..(pos + 1) * v], row));
        let abs = g
            .iter()
            .zip(row)
            .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()));
        worst_abs = worst_abs.max(abs);
    }
    let vs_cpu = worst_row_error(&got, &cpu_logits, v);
    println!(
        "{what}: cuda vs reference {worst:.2e}, cpu vs reference {cpu_worst:.2e}, cuda vs cpu {vs_cpu:.2e}"
    );
    let bound = if eight_bit {
        (1.5 * cpu_worst).max(1e-2)
    } else {
        1e-2
    };
    assert!(
        worst < bound,
        "{what}: cuda vs reference {worst:e} >= {bound:e}"
    );
    let last = on_gpu.prefill_logits(&tokens).unwrap();
    let last_err = relative_error(&last, &want[tokens.len() - 1]);
    assert!(
        last_err < bound,
        "{what}: prefill logits error {last_err:e} >= {bound:e}"
    );

    let prompt = &tokens[..8];
    let ours = greedy(&mut on_gpu, prompt);
    let cpu_tokens = greedy(&mut on_cpu, prompt);
    let same_as_cpu = ours
        .iter()
        .zip(&cpu_tokens)
        .take_while(|(a, b)| a == b)
        .count();
    if worst < 1e-4 {
        let theirs = reference.greedy(prompt, GREEDY_STEPS);
        assert_eq!(ours, theirs, "{what}: greedy tokens");
        println!("{what}: greedy tokens equal the reference's (the cpu's for {same_as_cpu})");
        return;
    }
    let max_ties = if eight_bit { 8 } else { 3 };
    let ties = reference.check_greedy(prompt, &ours, worst_abs, max_ties, what);
    println!(
        "{what}: greedy tokens are the reference's choices ({ties} near-ties), the cpu's for the first {same_as_cpu}"
    );
}

/// The cuda and cpu backends with KV caches of `cache` (K and V quantized alike on both),
/// within `tol`; returns the cuda logits.
fn compare_caches(file: &GgufFile, cache: GgmlType, tol: f32, what: &str) -> Vec<f32> {
    let n_vocab = ModelConfig::from_gguf(file).unwrap().n_vocab;
    let tokens = prompt(n_vocab);
    let mut on_cpu =
        Generator::from_file_with_cache(cpu(), file, CTX, UBATCH, cache, cache).unwrap();
    let mut on_gpu =
        Generator::from_file_with_cache(gpu(), file, CTX, UBATCH, cache, cache).unwrap();
    let want = on_cpu.eval_logits(&tokens).unwrap();
    let got = on_gpu.eval_logits(&tokens).unwrap();
    let err = worst_row_error(&got, &want, n_vocab);
    println!("{what}: cuda vs cpu {err:.2e}");
    assert!(err < tol, "{what}: relative error {err:e} >= {tol:e}");
    got
}

struct TempModel(PathBuf);

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn synth(shape: SynthShape, ty: GgmlType) -> (TempModel, GgufFile) {
    let path = std::env::temp_dir().join(format!(
        "tether-cuda-model-{}-{}-{ty}.gguf",
        std::process::id(),
        shape.name()
    ));
    synthesize(&path, shape, ty, 21).unwrap();
    let file = GgufFile::open(&path).unwrap();
    (TempModel(path), file)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn every_weight_type_matches_the_reference() {
    // Every type the synthesizer writes.
    let types = GgmlType::WEIGHTS;
    for shape in [
        SynthShape::Tiny,
        SynthShape::TinyQwen2,
        SynthShape::TinyQwen3,
        SynthShape::TinyQwen3Moe,
        SynthShape::TinyMixtral,
    ] {
        for ty in types {
            let (_tmp, file) = synth(shape, ty);
            let eight_bit = matches!(
                ty,
                GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
            );
            check_against_reference(&file, &format!("{} {ty}", shape.name()), eight_bit);
        }
    }
}

/// Gemma 3 (sliding windows of 8 positions under a 40-token prompt, two rope bases, GELU
/// gate, post-norms, scaled and tied embedding) and Phi-3 (fused q/k/v and gate/up held as
/// separate matrices), Gemma 2 (alternating windows, attention and logit soft-caps in the
/// decode and prefill attention kernels) and Qwen3 with YaRN in every weight type against
/// the reference; then
/// 64 greedy tokens from a float model equal on the cpu and the GPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemma_phi3_and_yarn_match_the_reference_and_the_cpu() {
    for shape in [
        SynthShape::TinyGemma3,
        SynthShape::TinyGemma2,
        SynthShape::TinyPhi3,
        SynthShape::TinyQwen3Yarn,
    ] {
        for ty in GgmlType::WEIGHTS {
            let (_tmp, file) = synth(shape, ty);
            let eight_bit = matches!(
                ty,
                GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
            );
            check_against_reference(&file, &format!("{} {ty}", shape.name()), eight_bit);
        }
        let (_tmp, file) = synth(shape, GgmlType::F16);
        greedy_tokens_equal_on_both(&file, shape.name());
    }
}

/// Quantized caches on the GPU: within 3e-2 (q8_0) or 1.5e-1 (q4_0) of the cpu with the
/// same cache type, and within the quantization's own error of the f16 cache (the cpu
/// test's bounds: 5e-2 for q8_0, 3e-1 for q4_0). tiny-qwen3's heads of 128 are four
/// cache blocks each.
#[test]
#[ignore = "needs a CUDA GPU"]
fn quantized_kv_caches_match_the_cpu() {
    for shape in [SynthShape::Tiny, SynthShape::TinyQwen3] {
        let (_tmp, file) = synth(shape, GgmlType::Q8_0);
        let name = shape.name();
        let n_vocab = ModelConfig::from_gguf(&file).unwrap().n_vocab;
        let f16 = compare_caches(
            &file,
            GgmlType::F16,
            3e-2,
            &format!("{name} q8_0, f16 cache"),
        );
        // Against the cpu: both quantize K and V alike, but the cpu's attention also rounds
        // its inputs to 8 bits, which a 4-bit cache's coarse values amplify (7.7e-2 measured).
        for (cache, bound, tol) in [(GgmlType::Q8_0, 5e-2, 3e-2), (GgmlType::Q4_0, 3e-1, 1.5e-1)] {
            let what = format!("{name} q8_0, {cache} cache");
            let got = compare_caches(&file, cache, tol, &what);
            let err = worst_row_error(&got, &f16, n_vocab);
            println!("{what} vs f16 cache on the GPU: {err:.2e}");
            assert!(err > 0.0 && err < bound, "{what}: {err:e} vs f16");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn stories260k_matches_the_reference() {
    let Some(path) = tether_test_data::stories260k() else {
        return;
    };
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    check_against_reference(&file, "stories260K", false);
}

fn stage_spec(first: usize, last: usize, embed: bool, head: bool) -> StageSpec {
    StageSpec {
        first_layer: first,
        last_layer: last,
        has_embed: embed,
        has_head: head,
        ctx_per_seq: CTX,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: UBATCH,
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    }
}

/// Decode steps through two stages, each on its own backend as on two workers (the hidden
/// states crossing on the host), give the whole model's logits on every step: the recorded
/// steps' staged inputs and pinned downloads carry the right values once replayed, not
/// only on the steps that run eagerly. The last stage's candidates selected on the device
/// are those of its logits.
#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_steps_split_over_two_backends_equal_one_stage() {
    // tiny-qwen3's layers put their normed q/k and the attention output in other buffers;
    // tiny-gemma3's post-norms use the feed-forward's, and its stages split sliding layers
    // from the global one; tiny-phi3 holds its fused tensors as parts; the MoE shapes'
    // recorded steps read expert ids the router wrote on the device.
    for shape in [
        SynthShape::Tiny,
        SynthShape::TinyQwen3,
        SynthShape::TinyGemma3,
        SynthShape::TinyGemma2,
        SynthShape::TinyPhi3,
        SynthShape::TinyQwen3Moe,
        SynthShape::TinyMixtral,
    ] {
        decode_steps_split_equal_one_stage(shape);
    }
}

fn decode_steps_split_equal_one_stage(shape: SynthShape) {
    let (_tmp, file) = synth(shape, GgmlType::Q4K);
    let n = ModelConfig::from_gguf(&file).unwrap().n_layer;
    let mid = n / 2;
    assert!(
        mid > 0 && mid < n,
        "the tiny model needs two layers or more"
    );
    let mut whole = load_stage_from_file(gpu(), &file, stage_spec(0, n, true, true)).unwrap();
    let mut a = load_stage_from_file(gpu(), &file, stage_spec(0, mid, true, false)).unwrap();
    let mut b = load_stage_from_file(gpu(), &file, stage_spec(mid, n, false, true)).unwrap();
    let (e, v) = (whole.config().n_embd, whole.config().n_vocab);
    let mut id = 7u32;
    for pos in 0..24u32 {
        let toks = [BatchToken { seq: 0, pos }];
        let mut want = vec![0.0; v];
        whole.decode_logits(&[id], &toks, &mut want).unwrap();
        let mut h = vec![0.0; e];
        a.decode_step(StepInput::Ids(&[id]), &toks, StepOutput::Hidden(&mut h))
            .unwrap();
        let mut got = vec![0.0; v];
        b.decode_step(StepInput::Hidden(&h), &toks, StepOutput::Logits(&mut got))
            .unwrap();
        let err = worst_row_error(&got, &want, v);
        assert!(
            err < 1e-6,
            "{}: step {pos}: split logits {err} from the whole model's",
            shape.name()
        );
        // The same step again, selecting 40 candidates on the device instead.
        let mut top = vec![Vec::new()];
        b.decode_step(StepInput::Hidden(&h), &toks, StepOutput::Top(40, &mut top))
            .unwrap();
        let mut from_logits = Vec::new();
        tether_model::sampling::top_candidates(&got, 40, &mut from_logits);
        let bits = |c: &[(u32, f32)]| c.iter().map(|c| (c.0, c.1.to_bits())).collect::<Vec<_>>();
        assert_eq!(
            bits(&top[0]),
            bits(&from_logits),
            "step {pos}: device candidates"
        );
        // Again, reducing what log-probabilities need on the device: 5 candidates, the
        // row's log-sum-exp and the logit of a target.
        let (mut top5, mut scores) = (vec![Vec::new()], vec![(0.0f32, 0.0f32)]);
        let scored = StepOutput::Scored {
            k: 5,
            targets: &[id],
            top: &mut top5,
            scores: &mut scores,
        };
        b.decode_step(StepInput::Hidden(&h), &toks, scored).unwrap();
        assert_eq!(bits(&top5[0]), bits(&from_logits[..5]), "step {pos}: top 5");
        let lse = tether_model::sampling::logsumexp(&got);
        assert!(
            (scores[0].0 - lse).abs() <= 1e-4 * lse.abs().max(1.0),
            "step {pos}: device log-sum-exp {} against {lse}",
            scores[0].0
        );
        assert_eq!(
            scores[0].1.to_bits(),
            got[id as usize].to_bits(),
            "step {pos}: target"
        );
        let next = tether_model::sampling::greedy(&want);
        assert_ne!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            vec![0; v],
            "step {pos}: no logits came back"
        );
        id = next;
    }
}

/// Mixture-of-experts models in f32 and f16 generate the same 64 greedy tokens on the GPU
/// as on the cpu (prefill in micro-batches, then recorded decode steps).
#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_greedy_tokens_equal_the_cpus() {
    for shape in [SynthShape::TinyQwen3Moe, SynthShape::TinyMixtral] {
        for ty in [GgmlType::F32, GgmlType::F16] {
            let (_tmp, file) = synth(shape, ty);
            greedy_tokens_equal_on_both(&file, &format!("{} {ty}", shape.name()));
        }
    }
}

/// 64 greedy tokens from an 8-token prompt are the same on the GPU as on the cpu.
fn greedy_tokens_equal_on_both(file: &GgufFile, what: &str) {
    let tokens = prompt(ModelConfig::from_gguf(file).unwrap().n_vocab);
    let mut on_gpu = Generator::from_file(gpu(), file, CTX, UBATCH).unwrap();
    let mut on_cpu = Generator::from_file(cpu(), file, CTX, UBATCH).unwrap();
    assert_eq!(
        greedy(&mut on_gpu, &tokens[..8]),
        greedy(&mut on_cpu, &tokens[..8]),
        "{what}: greedy tokens cpu vs cuda"
    );
}

/// The rows an embedding pools (the output norm's, `Stage::output_normed`) on the GPU
/// against the reference's last hidden state, over more than one micro-batch, for a plain
/// llama, Qwen3's per-head norms and Gemma's stored (1 + w) norm gains.
#[test]
#[ignore = "needs a CUDA GPU"]
fn normed_hidden_states_match_the_reference() {
    for shape in [
        SynthShape::Tiny,
        SynthShape::TinyQwen3,
        SynthShape::TinyGemma3,
    ] {
        let (_tmp, file) = synth(shape, GgmlType::F16);
        let n = ModelConfig::from_gguf(&file).unwrap().n_layer;
        let mut stage = load_stage_from_file(gpu(), &file, stage_spec(0, n, true, true)).unwrap();
        let e = stage.config().n_embd;
        let ids = prompt(stage.config().n_vocab);
        let mut h = vec![0.0; ids.len() * e];
        stage.embed(&ids, &mut h).unwrap();
        for (k, chunk) in h.chunks_mut(UBATCH * e).enumerate() {
            let toks: Vec<BatchToken> = (0..chunk.len() / e)
                .map(|i| BatchToken {
                    seq: 0,
                    pos: (k * UBATCH + i) as u32,
                })
                .collect();
            stage.forward(&toks, chunk).unwrap();
        }
        let mut got = vec![0.0; ids.len() * e];
        stage.output_normed(&h, ids.len(), &mut got).unwrap();
        let want = Reference::load(&file).normed_hidden(&ids);
        let worst = want
            .iter()
            .enumerate()
            .map(|(p, row)| relative_error(&got[p * e..(p + 1) * e], row))
            .fold(0f64, f64::max);
        println!(
            "{}: normed hidden states, worst relative error {worst:.2e}",
            shape.name()
        );
        assert!(worst < 1e-2, "{}: {worst:e}", shape.name());
    }
}

/// A 16-token step handed from one stage's device to the next's (the first leaves its
/// output in a hand-off slot, the second copies it from there) gives the same logits,
/// bit for bit, as the same step with the hidden states crossing on the host; every slot
/// takes a turn, and a lent range of the wrong size, an address with the wrong key or a
/// step that would replay is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn hidden_states_handed_between_devices_equal_the_host_path() {
    let (_tmp, file) = synth(SynthShape::Tiny, GgmlType::Q4K);
    let n = ModelConfig::from_gguf(&file).unwrap().n_layer;
    let mid = n / 2;
    let load = |first, last, embed, head| {
        load_stage_from_file(gpu(), &file, stage_spec(first, last, embed, head)).unwrap()
    };
    let (mut a_host, mut b_host) = (load(0, mid, true, false), load(mid, n, false, true));
    let (mut a, mut b) = (load(0, mid, true, false), load(mid, n, false, true));
    let (e, v) = (a.config().n_embd, a.config().n_vocab);
    let slots = tether_model::plan::HANDOFF_SLOTS;
    let ids: Vec<u32> = (0..((slots + 1) * UBATCH) as u32)
        .map(|i| (i * 7919 + 13) % v as u32)
        .collect();
    let mut views = Vec::new();
    for (step, chunk) in ids.chunks(UBATCH).enumerate().take(slots + 1) {
        let start = (step * UBATCH) as u32;
        let toks: Vec<BatchToken> = (0..chunk.len() as u32)
            .map(|i| BatchToken {
                seq: 0,
                pos: start + i,
            })
            .collect();
        let mut h = vec![0.0; toks.len() * e];
        a_host
            .decode_step(StepInput::Ids(chunk), &toks, StepOutput::Hidden(&mut h))
            .unwrap();
        let mut want = vec![0.0; toks.len() * v];
        b_host
            .decode_step(StepInput::Hidden(&h), &toks, StepOutput::Logits(&mut want))
            .unwrap();

        let mut area = None;
        let slot = step % slots;
        a.decode_step(
            StepInput::Ids(chunk),
            &toks,
            StepOutput::Slot(slot, &mut area),
        )
        .unwrap();
        let area = area.expect("a slot's range");
        assert_eq!(area.len, (4 * toks.len() * e) as u64);
        // Inside one process the address is taken only with the lender's key.
        let forged = tether_compute::SharedArea {
            key: area.key ^ 1,
            ..area
        };
        assert!(
            b.backend().open_shared(&forged).is_err(),
            "an address with the wrong key was opened"
        );
        let view = b.backend().open_shared(&area).unwrap();
        let short = area.prefix(area.len - 4).unwrap();
        let mut got = vec![0.0; toks.len() * v];
        let refused = b.decode_step(
            StepInput::Lent(&view, &short),
            &toks,
            StepOutput::Logits(&mut got),
        );
        assert!(refused.is_err(), "a range 4 bytes short was taken");
        b.decode_step(
            StepInput::Lent(&view, &area),
            &toks,
            StepOutput::Logits(&mut got),
        )
        .unwrap();
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&got) == bits(&want),
            "step {step}: handed-over logits differ from the host path's"
        );
        views.push(view);
    }
    assert_eq!(views.len(), slots + 1, "every slot took a turn");
    // Eight tokens replay a recorded step: refused either way.
    let next = ids.len() as u32;
    let toks: Vec<BatchToken> = (0..8)
        .map(|i| BatchToken {
            seq: 0,
            pos: next + i,
        })
        .collect();
    let mut area = None;
    let refused = a.decode_step(
        StepInput::Ids(&ids[..8]),
        &toks,
        StepOutput::Slot(0, &mut area),
    );
    let e = refused.expect_err("an 8-token hand-off");
    assert!(e.to_string().contains("more than 8 tokens"), "{e}");
    assert!(area.is_none());
}
