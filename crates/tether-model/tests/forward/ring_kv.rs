//! Sliding-window layers that keep only their window (a ring of `window + ubatch` cells per
//! sequence): logits equal those of a stage whose sliding layers keep the whole context and
//! the f64 reference's, far past the window, with micro-batches that cross the ring's wrap;
//! prefix copies and truncations the ring can serve give the same logits, the others are
//! refused (copies) or clear the sequence (truncations).

use tether_gguf::GgmlType;
use tether_model::{
    BatchToken, Generator, ModelConfig, Sampler, SamplingParams, Stage, SynthShape,
    load_stage_from_file, plan_stage,
};

use crate::reference_model::{Reference, relative_error};
use crate::support::{TempModel, backend, run, spec, synth};

/// 56 tokens: seven windows of tiny-gemma's 8 positions.
fn long_tokens() -> Vec<u32> {
    (0..56u32).map(|i| 1 + (i * 37 + 11) % 300).collect()
}

/// A whole-model stage of 2 sequences of 64 positions; with `ubatch` 56 or more the rings
/// would not be shorter than the context, so its sliding layers keep the whole context.
fn stage(m: &TempModel, ubatch: usize) -> Stage<tether_compute::CpuBackend> {
    let n = ModelConfig::from_gguf(&m.file).unwrap().n_layer;
    load_stage_from_file(backend(), &m.file, spec(0, n, true, true, 2, ubatch)).unwrap()
}

/// Runs `ids` at positions `from..` of `seq` in micro-batches of `chunk`; every row's logits.
fn feed(
    st: &mut Stage<tether_compute::CpuBackend>,
    seq: u32,
    from: u32,
    ids: &[u32],
    chunk: usize,
) -> Vec<f32> {
    let mut out = Vec::new();
    for (c, part) in ids.chunks(chunk).enumerate() {
        let start = from + (c * chunk) as u32;
        let toks: Vec<BatchToken> = (0..part.len() as u32)
            .map(|i| BatchToken {
                seq,
                pos: start + i,
            })
            .collect();
        out.extend(run(st, part, &toks));
    }
    out
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    let size = want.iter().fold(0f32, |m, b| m.max(b.abs()));
    assert!(diff <= 1e-5 * size, "{what}: {diff} of {size}");
}

#[test]
fn rings_hold_only_the_window_and_the_plan_says_so() {
    let m = synth(SynthShape::TinyGemma3, GgmlType::F32, 300);
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let (ring, whole) = (stage(&m, 4), stage(&m, 60));
    let kv = |ub| {
        let s = spec(0, cfg.n_layer, true, true, 2, ub);
        let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
        plan_stage(&cfg, &s, &slots).kv_bytes
    };
    // Five sliding layers of 8 + 4 cells and one global of 64, for 2 sequences, K and V,
    // and the global layers' block table (a u32 for each sequence's 2 blocks of 32 cells).
    let cell = (cfg.n_head_kv * cfg.head_dim * 2) as u64;
    let table = 2 * 2 * 4;
    assert_eq!(kv(4), 2 * 2 * cell * (5 * 12 + 64) + table);
    assert_eq!(kv(60), 2 * 2 * cell * 6 * 64 + table);
    assert!(ring.bytes() < whole.bytes());
}

#[test]
fn ring_logits_equal_whole_context_logits_far_past_the_window() {
    for (shape, seed) in [(SynthShape::TinyGemma3, 301), (SynthShape::TinyGemma2, 302)] {
        let m = synth(shape, GgmlType::F32, seed);
        let ids = long_tokens();
        let want = feed(&mut stage(&m, 60), 0, 0, &ids, 3);
        // Micro-batches of 3 (rings of 11: chunks straddle the wrap), 5 and 1.
        for ub in [3, 5, 1] {
            let got = feed(&mut stage(&m, ub), 0, 0, &ids, ub);
            assert_close(&format!("{} ubatch {ub}", shape.name()), &got, &want);
        }
    }
}

#[test]
fn ring_logits_and_greedy_tokens_match_the_reference() {
    for (shape, seed) in [(SynthShape::TinyGemma3, 303), (SynthShape::TinyGemma2, 304)] {
        let m = synth(shape, GgmlType::F32, seed);
        let reference = Reference::load(&m.file);
        let ids = long_tokens();
        let theirs = reference.logits(&ids);
        let v = reference.vocab();
        // Context 128, micro-batches of 5: rings of 13 cells.
        let mut generator = Generator::from_file(backend(), &m.file, 128, 5).unwrap();
        let ours = generator.eval_logits(&ids).unwrap();
        for (pos, want) in theirs.iter().enumerate() {
            let err = relative_error(&ours[pos * v..(pos + 1) * v], want);
            assert!(
                err < 1e-3,
                "{}: position {pos}: relative error {err:e}",
                shape.name()
            );
        }
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let (got, _) = generator
            .generate(&[1, 300], 48, &mut sampler, &[], |_| true)
            .unwrap();
        assert_eq!(
            got,
            reference.greedy(&[1, 300], 48),
            "{}: greedy tokens",
            shape.name()
        );
    }
}

#[test]
fn prefix_copies_the_ring_still_holds_continue_like_the_whole_context() {
    let m = synth(SynthShape::TinyGemma3, GgmlType::F32, 305);
    let ids = long_tokens();
    let (mut ring, mut whole) = (stage(&m, 4), stage(&m, 60));
    feed(&mut ring, 0, 0, &ids[..40], 4);
    feed(&mut whole, 0, 0, &ids[..40], 4);
    // The last micro-batch wrote 36..40: the ring of 12 holds 28..40, and position 38 needs
    // 31..38. Position 30 needs 23..30, which are gone.
    assert!(ring.kv_reusable(0, 30).unwrap() == 0);
    assert!(ring.kv_copy(0, 1, 30).is_err(), "a window the ring lost");
    assert_eq!(ring.kv_reusable(0, 38).unwrap(), 38);
    ring.kv_copy(0, 1, 38).unwrap();
    whole.kv_copy(0, 1, 38).unwrap();
    let got = feed(&mut ring, 1, 38, &ids[38..], 4);
    let want = feed(&mut whole, 1, 38, &ids[38..], 4);
    assert_close("after a copy", &got, &want);
}

#[test]
fn truncations_below_the_ring_clear_the_sequence_and_others_continue() {
    let m = synth(SynthShape::TinyGemma3, GgmlType::F32, 306);
    let ids = long_tokens();
    let (mut ring, mut whole) = (stage(&m, 4), stage(&m, 60));
    feed(&mut ring, 0, 0, &ids[..44], 4);
    feed(&mut whole, 0, 0, &ids[..44], 4);
    // Held: 32..44. Keeping 41 needs 34..41: held.
    assert_eq!(ring.kv_truncate(0, 41).unwrap(), 41);
    whole.kv_truncate(0, 41).unwrap();
    let got = feed(&mut ring, 0, 41, &ids[41..], 4);
    let want = feed(&mut whole, 0, 41, &ids[41..], 4);
    assert_close("after keeping 41", &got, &want);
    // Keeping 20 needs 13..20, long overwritten: the sequence is cleared, and a prefill
    // from its start gives the whole context's logits again.
    assert_eq!(ring.kv_truncate(0, 20).unwrap(), 0);
    assert_eq!(ring.seq_len(0).unwrap(), 0);
    let toks = [BatchToken { seq: 0, pos: 20 }];
    let mut h = vec![0.0; ring.config().n_embd];
    assert!(
        ring.forward(&toks, &mut h).is_err(),
        "position 20 of an empty sequence"
    );
    whole.kv_truncate(0, 20).unwrap();
    let got = feed(&mut ring, 0, 0, &ids[..30], 4);
    let want = feed(&mut whole, 0, 20, &ids[20..30], 4);
    assert_close("prefilled again", &got[20 * got.len() / 30..], &want);
}
