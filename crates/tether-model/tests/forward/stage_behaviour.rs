//! Splitting, KV truncation, sequence interleaving, memory accounting and bad input.

use tether_compute::CpuBackend;
use tether_gguf::GgmlType;
use tether_model::{
    BatchToken, ModelConfig, ModelError, Stage, StepInput, StepOutput, SynthShape,
    load_stage_from_file, plan_stage,
};
use tether_model::{Generator, Sampler, SamplingParams, StopReason};

use crate::support::{TempModel, backend, run, spec, synth, whole};

fn batch(seq: u32, positions: std::ops::Range<u32>) -> Vec<BatchToken> {
    positions.map(|pos| BatchToken { seq, pos }).collect()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn model() -> TempModel {
    synth(SynthShape::Tiny, GgmlType::Q4K, 5)
}

const IDS: [u32; 10] = [1, 300, 17, 260, 45, 299, 3, 270, 288, 100];

/// The models the stage tests run on: llama, qwen3 (q/k norms and heads wider than
/// `n_embd / n_head` move the attention through other scratch buffers), and the two
/// mixture-of-experts shapes (router and expert scratch of their own).
fn models() -> [TempModel; 4] {
    [
        model(),
        synth(SynthShape::TinyQwen3, GgmlType::Q4K, 5),
        synth(SynthShape::TinyQwen3Moe, GgmlType::Q4K, 5),
        synth(SynthShape::TinyMixtral, GgmlType::Q4K, 5),
    ]
}

#[test]
fn two_half_stages_equal_one_stage() {
    for m in models() {
        two_half_stages_equal_one_stage_of(&m);
    }
}

fn two_half_stages_equal_one_stage_of(m: &TempModel) {
    let mut one = whole(&m.file, 1, 4);
    let want = run(&mut one, &IDS, &batch(0, 0..10));
    let mut a = load_stage_from_file(backend(), &m.file, spec(0, 1, true, false, 1, 4)).unwrap();
    let mut b = load_stage_from_file(backend(), &m.file, spec(1, 2, false, true, 1, 4)).unwrap();
    let cfg = a.config().clone();
    let mut h = vec![0.0; IDS.len() * cfg.n_embd];
    a.embed(&IDS, &mut h).unwrap();
    a.forward(&batch(0, 0..10), &mut h).unwrap();
    b.forward(&batch(0, 0..10), &mut h).unwrap();
    let mut got = vec![0.0; IDS.len() * cfg.n_vocab];
    b.logits(&h, IDS.len(), &mut got).unwrap();
    assert!(max_rel_diff(&got, &want) < 1e-6);
}

#[test]
fn decode_logits_equals_embed_forward_and_logits() {
    let m = model();
    let (mut a, mut b) = (whole(&m.file, 2, 4), whole(&m.file, 2, 4));
    let v = a.config().n_vocab;
    // A prompt on both, then decode steps of one token and of two sequences at once.
    let prompt = run(&mut a, &IDS[..4], &batch(0, 0..4));
    assert_eq!(run(&mut b, &IDS[..4], &batch(0, 0..4)), prompt);
    let steps: [(&[u32], Vec<BatchToken>); 3] = [
        (&[7], batch(0, 4..5)),
        (
            &[9, 11],
            vec![BatchToken { seq: 0, pos: 5 }, BatchToken { seq: 1, pos: 0 }],
        ),
        (&[300], batch(1, 1..2)),
    ];
    for (ids, toks) in &steps {
        let want = run(&mut a, ids, toks);
        let mut got = vec![0.0; ids.len() * v];
        b.decode_logits(ids, toks, &mut got).unwrap();
        assert_eq!(got, want, "{ids:?}");
    }
    // Bad input changes nothing: the next step still matches.
    let mut out = vec![0.0; v];
    let bad = [BatchToken { seq: 0, pos: 6 }];
    assert!(
        b.decode_logits(&[v as u32], &bad, &mut out).is_err(),
        "id past the vocab"
    );
    assert!(
        b.decode_logits(&[1, 2], &bad, &mut out).is_err(),
        "ids and tokens differ"
    );
    let far = [BatchToken { seq: 0, pos: 9 }];
    assert!(
        b.decode_logits(&[1], &far, &mut out).is_err(),
        "position past the end"
    );
    let many: Vec<BatchToken> = batch(0, 6..15);
    let mut big = vec![0.0; many.len() * v];
    assert!(
        b.decode_logits(&[1; 9], &many, &mut big).is_err(),
        "more than a step"
    );
    let want = run(&mut a, &[5], &bad);
    b.decode_logits(&[5], &bad, &mut out).unwrap();
    assert_eq!(out, want);
}

#[test]
fn decode_steps_past_the_replay_size_equal_embed_forward_and_logits() {
    // Twelve tokens of three sequences in one step: more than a replayed step holds, as
    // when many sequences decode at once. Every output a worker asks for comes from the
    // device path and must equal the host's forward, logits and selection.
    let m = model();
    let (mut a, mut b) = (whole(&m.file, 3, 16), whole(&m.file, 3, 16));
    let v = a.config().n_vocab;
    for seq in [0, 2] {
        let prompt = run(&mut a, &IDS[..4], &batch(seq, 0..4));
        assert_eq!(run(&mut b, &IDS[..4], &batch(seq, 0..4)), prompt);
    }
    let starts = [4u32, 0, 4];
    let toks: Vec<BatchToken> = (0..4u32)
        .flat_map(|i| (0..3u32).map(move |seq| (seq, i)))
        .map(|(seq, i)| BatchToken {
            seq,
            pos: starts[seq as usize] + i,
        })
        .collect();
    let ids: Vec<u32> = (0..toks.len())
        .map(|i| IDS[i % IDS.len()] + i as u32)
        .collect();
    assert!(toks.len() > 8 && toks.len() <= b.decode_step_tokens());
    let want = run(&mut a, &ids, &toks);
    let rewind = |s: &mut Stage<CpuBackend>| {
        for (seq, &len) in starts.iter().enumerate() {
            s.kv_truncate(seq as u32, len).unwrap();
        }
    };
    let mut got = vec![0.0; toks.len() * v];
    b.decode_logits(&ids, &toks, &mut got).unwrap();
    assert_eq!(got, want);
    rewind(&mut b);
    let mut argmax = vec![0; toks.len()];
    b.decode_step(StepInput::Ids(&ids), &toks, StepOutput::ArgMax(&mut argmax))
        .unwrap();
    let greedy: Vec<u32> = want.chunks(v).map(tether_model::sampling::greedy).collect();
    assert_eq!(argmax, greedy);
    rewind(&mut b);
    let mut top = vec![Vec::new(); toks.len()];
    b.decode_step(StepInput::Ids(&ids), &toks, StepOutput::Top(5, &mut top))
        .unwrap();
    for (row, got) in want.chunks(v).zip(&top) {
        let mut expect = Vec::new();
        tether_model::sampling::top_candidates(row, 5, &mut expect);
        assert_eq!(got, &expect);
    }
    // A head over chosen rows (prompt chunks beside decode tokens): the rows' own outputs.
    let chosen = [0u32, 5, 6, 11];
    let step_rows = |s: &mut Stage<CpuBackend>, rows: &[u32], out: StepOutput<'_>| {
        s.decode_step_rows(StepInput::Ids(&ids), &toks, rows, out)
    };
    rewind(&mut b);
    let mut logits = vec![0.0; chosen.len() * v];
    step_rows(&mut b, &chosen, StepOutput::Logits(&mut logits)).unwrap();
    for (j, &r) in chosen.iter().enumerate() {
        let r = r as usize;
        // The head's products over 4 rows and over 12 may group their sums differently.
        let diff = max_rel_diff(&logits[j * v..(j + 1) * v], &want[r * v..(r + 1) * v]);
        assert!(diff < 1e-5, "row {r}: {diff}");
    }
    rewind(&mut b);
    let mut picked = vec![0; chosen.len()];
    step_rows(&mut b, &chosen, StepOutput::ArgMax(&mut picked)).unwrap();
    let expect: Vec<u32> = chosen.iter().map(|&r| greedy[r as usize]).collect();
    assert_eq!(picked, expect);
    rewind(&mut b);
    for bad in [&[5u32, 5][..], &[6, 5], &[toks.len() as u32]] {
        let mut out = vec![0; bad.len()];
        let refused = step_rows(&mut b, bad, StepOutput::ArgMax(&mut out));
        assert!(refused.is_err(), "rows {bad:?}");
    }
    // Refused steps wrote no cells: the step runs now as it did first.
    step_rows(&mut b, &chosen, StepOutput::ArgMax(&mut picked)).unwrap();
    assert_eq!(picked, expect);
    // The cells hold what the host path wrote: the next step of each sequence matches.
    let next: Vec<BatchToken> = (0..3u32)
        .map(|seq| BatchToken {
            seq,
            pos: starts[seq as usize] + 4,
        })
        .collect();
    let want = run(&mut a, &[3, 4, 5], &next);
    let mut got = vec![0.0; 3 * v];
    b.decode_logits(&[3, 4, 5], &next, &mut got).unwrap();
    assert_eq!(got, want);
}

#[test]
fn decode_steps_across_two_stages_equal_the_whole_model() {
    for m in models() {
        decode_steps_across_two_stages_of(&m);
    }
}

fn decode_steps_across_two_stages_of(m: &TempModel) {
    let mut one = whole(&m.file, 2, 4);
    let mut a = load_stage_from_file(backend(), &m.file, spec(0, 1, true, false, 2, 4)).unwrap();
    let mut b = load_stage_from_file(backend(), &m.file, spec(1, 2, false, true, 2, 4)).unwrap();
    let (e, v) = (a.config().n_embd, a.config().n_vocab);
    let greedy = tether_model::sampling::greedy;
    let steps: [(&[u32], Vec<BatchToken>); 3] = [
        (&IDS[..1], batch(0, 0..1)),
        (
            &[9, 11],
            vec![BatchToken { seq: 0, pos: 1 }, BatchToken { seq: 1, pos: 0 }],
        ),
        (&[300], batch(1, 1..2)),
    ];
    for (ids, toks) in &steps {
        let want = run(&mut one, ids, toks);
        let mut h = vec![0.0; ids.len() * e];
        a.decode_step(StepInput::Ids(ids), toks, StepOutput::Hidden(&mut h))
            .unwrap();
        // Stage b runs the step twice from the same cells: once for the logits, then
        // (its cells of the step forgotten) once for the arg-max.
        let mut logits = vec![0.0; ids.len() * v];
        b.decode_step(StepInput::Hidden(&h), toks, StepOutput::Logits(&mut logits))
            .unwrap();
        assert!(max_rel_diff(&logits, &want) < 1e-6, "{ids:?}");
        for t in toks {
            b.kv_truncate(t.seq, t.pos).unwrap();
        }
        let mut top = vec![u32::MAX; ids.len()];
        b.decode_step(StepInput::Hidden(&h), toks, StepOutput::ArgMax(&mut top))
            .unwrap();
        let want_top: Vec<u32> = logits.chunks(v).map(greedy).collect();
        assert_eq!(top, want_top, "{ids:?}");
    }
    // What a stage lacks, or a bad size, fails before any cell is written.
    let at = batch(0, 2..3);
    let (len_a, len_b) = (a.seq_len(0).unwrap(), b.seq_len(0).unwrap());
    let mut h = vec![0.0; e];
    let mut ids = [0u32];
    let refused = [
        b.decode_step(StepInput::Ids(&[5]), &at, StepOutput::Hidden(&mut h)),
        a.decode_step(StepInput::Ids(&[5]), &at, StepOutput::ArgMax(&mut ids)),
        a.decode_step(StepInput::Ids(&[5, 6]), &at, StepOutput::Hidden(&mut h)),
        b.decode_step(
            StepInput::Hidden(&h[1..]),
            &at,
            StepOutput::ArgMax(&mut ids),
        ),
    ];
    for (i, r) in refused.into_iter().enumerate() {
        assert!(r.is_err(), "case {i} was accepted");
    }
    assert_eq!(
        (a.seq_len(0).unwrap(), b.seq_len(0).unwrap()),
        (len_a, len_b)
    );
    let want = run(&mut one, &[5], &at);
    a.decode_step(StepInput::Ids(&[5]), &at, StepOutput::Hidden(&mut h))
        .unwrap();
    b.decode_step(StepInput::Hidden(&h), &at, StepOutput::ArgMax(&mut ids))
        .unwrap();
    assert_eq!(ids[0], greedy(&want));
}

#[test]
fn truncate_then_reforward_reproduces_logits() {
    let m = model();
    let mut stage = whole(&m.file, 1, 16);
    let v = stage.config().n_vocab;
    let want = run(&mut stage, &IDS, &batch(0, 0..10));
    stage.kv_truncate(0, 6).unwrap();
    assert_eq!(stage.seq_len(0).unwrap(), 6);
    let got = run(&mut stage, &IDS[6..], &batch(0, 6..10));
    assert!(max_rel_diff(&got, &want[6 * v..]) < 1e-4);
    stage.kv_clear(0).unwrap();
    let again = run(&mut stage, &IDS, &batch(0, 0..10));
    assert!(max_rel_diff(&again, &want) < 1e-6);
}

#[test]
fn interleaved_sequences_equal_separate_runs() {
    let m = model();
    let mut stage = whole(&m.file, 3, 4);
    let v = stage.config().n_vocab;
    let a = run(&mut stage, &IDS[..5], &batch(2, 0..5));
    let b = run(&mut stage, &IDS[5..], &batch(0, 0..5));
    stage.kv_clear(0).unwrap();
    stage.kv_clear(2).unwrap();
    let mut ids = Vec::new();
    let mut toks = Vec::new();
    for i in 0..5u32 {
        ids.extend([IDS[i as usize], IDS[5 + i as usize]]);
        toks.extend([BatchToken { seq: 2, pos: i }, BatchToken { seq: 0, pos: i }]);
    }
    let mixed = run(&mut stage, &ids, &toks);
    for i in 0..5 {
        let row = |x: &[f32], r: usize| x[r * v..(r + 1) * v].to_vec();
        assert!(
            max_rel_diff(&row(&mixed, 2 * i), &row(&a, i)) < 1e-4,
            "seq 2 pos {i}"
        );
        assert!(
            max_rel_diff(&row(&mixed, 2 * i + 1), &row(&b, i)) < 1e-4,
            "seq 0 pos {i}"
        );
    }
}

#[test]
fn bytes_equal_the_plan_and_serving_allocates_nothing() {
    for shape in [
        SynthShape::TinyQwen2,
        SynthShape::TinyQwen3,
        SynthShape::TinyQwen3Moe,
        SynthShape::TinyMixtral,
    ] {
        bytes_equal_the_plan_of(shape);
    }
}

fn bytes_equal_the_plan_of(shape: SynthShape) {
    let m = synth(shape, GgmlType::Q8_0, 6);
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    for s in [
        spec(0, 2, true, true, 2, 8),
        spec(0, 1, true, false, 1, 3),
        spec(1, 2, false, true, 4, 1),
        spec(0, 0, true, true, 1, 2),
    ] {
        let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
        let plan = plan_stage(&cfg, &s, &slots);
        let mut stage = load_stage_from_file(backend(), &m.file, s.clone()).unwrap();
        assert_eq!(stage.bytes(), plan.total_bytes, "{s:?}");
        let allocs = stage.alloc_count();
        assert!(allocs as usize >= slots.len());
        if s.last_layer > s.first_layer {
            let mut h = vec![0.5; 7 * cfg.n_embd];
            for round in 0..5 {
                stage.kv_clear(0).unwrap();
                stage.forward(&batch(0, 0..7), &mut h).unwrap();
                stage
                    .forward(&batch(0, 7..8), &mut h[..cfg.n_embd])
                    .unwrap_or_else(|e| panic!("round {round}: {e}"));
            }
        }
        assert_eq!(stage.alloc_count(), allocs);
        assert_eq!(stage.bytes(), plan.total_bytes);
    }
    // K and V of 2 layers, 2 sequences of 64 cells, f16; and the block table, a u32 for
    // each sequence's 2 blocks of 32 cells.
    let kv = 2 * 2 * (2 * 64) * cfg.kv_dim() as u64 * 2 + 2 * 2 * 4;
    let s = spec(0, 2, true, true, 2, 8);
    let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
    assert_eq!(plan_stage(&cfg, &s, &slots).kv_bytes, kv);
}

#[test]
fn bad_batches_are_refused_and_change_nothing() {
    let m = model();
    let mut stage = whole(&m.file, 2, 4);
    let e = stage.config().n_embd;
    let mut h = vec![0.1; 3 * e];
    stage.forward(&batch(1, 0..3), &mut h).unwrap();
    for bad in [
        batch(1, 4..5),
        batch(2, 0..1),
        batch(0, 64..65),
        vec![BatchToken { seq: 0, pos: 1 }],
    ] {
        let mut h = vec![0.1; e];
        let err = stage.forward(&bad, &mut h).unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidArgument(_)),
            "{bad:?}: {err}"
        );
        assert_eq!(h, vec![0.1; e], "hidden untouched");
    }
    assert_eq!(stage.seq_len(1).unwrap(), 3);
    assert_eq!(stage.seq_len(0).unwrap(), 0);
    let mut h = vec![0.0; e];
    assert!(
        stage.embed(&[320], &mut h).is_err(),
        "id past the vocabulary"
    );
    assert!(
        stage.forward(&batch(0, 0..2), &mut h).is_err(),
        "hidden of the wrong size"
    );
}

#[test]
fn loading_checks_bounds_and_completeness() {
    let m = model();
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let s = spec(0, 1, true, false, 1, 2);
    let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
    let mut stage = Stage::new(backend(), cfg, s, &slots).unwrap();
    let first = &slots[0];
    assert!(
        stage
            .load_tensor(&first.name, first.bytes - 1, &[0, 0])
            .is_err()
    );
    assert!(
        stage.load_tensor("blk.1.attn_q.weight", 0, &[0]).is_err(),
        "not in this stage"
    );
    for slot in &slots {
        let t = m.file.tensor(&slot.name).unwrap();
        let data = m.file.tensor_data(t);
        if slot.name == "blk.0.ffn_up.weight" {
            stage
                .load_tensor(&slot.name, 0, &data[..data.len() / 2])
                .unwrap();
            continue;
        }
        let mid = data.len() / 3;
        stage
            .load_tensor(&slot.name, mid as u64, &data[mid..])
            .unwrap();
        stage.load_tensor(&slot.name, 0, &data[..mid]).unwrap();
    }
    let err = stage.finish_load().unwrap_err().to_string();
    assert!(err.contains("blk.0.ffn_up.weight"), "{err}");
    let mut h = vec![0.0; cfg_embd(&stage)];
    assert!(
        stage.embed(&[1], &mut h).is_err(),
        "not ready before a complete load"
    );

    // Completed and finished, a weight takes no more writes (a backend may have changed
    // its layout), and the stage still runs.
    let up = m.file.tensor("blk.0.ffn_up.weight").unwrap();
    let data = m.file.tensor_data(up);
    let half = data.len() / 2;
    stage
        .load_tensor("blk.0.ffn_up.weight", half as u64, &data[half..])
        .unwrap();
    stage.finish_load().unwrap();
    let err = stage
        .load_tensor("blk.0.ffn_up.weight", 0, &data[..16])
        .unwrap_err()
        .to_string();
    assert!(err.contains("already loaded in full"), "{err}");
    stage.embed(&[1], &mut h).unwrap();
}

fn cfg_embd(stage: &Stage<CpuBackend>) -> usize {
    stage.config().n_embd
}

#[test]
fn config_errors_name_the_problem() {
    let m = model();
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let mut tensors = m.file.tensors().to_vec();
    let t = tensors
        .iter_mut()
        .find(|t| t.name == "blk.1.attn_k.weight")
        .unwrap();
    t.dims = vec![256, 64];
    let err =
        tether_model::required_tensors(&cfg, &spec(0, 2, true, true, 1, 1), &tensors).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("blk.1.attn_k.weight")
            && msg.contains("[256, 128]")
            && msg.contains("[256, 64]"),
        "{msg}"
    );
    tensors.retain(|t| t.name != "blk.0.ffn_gate.weight");
    let err = tether_model::required_tensors(&cfg, &spec(0, 1, false, false, 1, 1), &tensors)
        .unwrap_err();
    assert!(err.to_string().contains("blk.0.ffn_gate.weight"));
    assert!(
        tether_model::required_tensors(&cfg, &spec(1, 3, false, false, 1, 1), &tensors).is_err()
    );
}

#[test]
fn generation_stops_at_end_of_generation_and_on_request() {
    let m = model();
    let mut g = Generator::new(whole(&m.file, 1, 4)).unwrap();
    let mut greedy = Sampler::new(SamplingParams::greedy());
    let (free, why) = g
        .generate(&[1, 300], 6, &mut greedy, &[], |_| true)
        .unwrap();
    assert_eq!((free.len(), why), (6, StopReason::Limit));
    let (out, why) = g
        .generate(&[1, 300], 6, &mut greedy, &[free[2]], |_| true)
        .unwrap();
    assert_eq!(why, StopReason::EndOfGeneration);
    assert_eq!(
        out,
        free[..free.iter().position(|&t| t == free[2]).unwrap()].to_vec()
    );
    let mut seen = 0;
    let (out, why) = g
        .generate(&[1, 300], 6, &mut greedy, &[], |_| {
            seen += 1;
            seen < 3
        })
        .unwrap();
    assert_eq!((out.len(), why), (3, StopReason::Callback));
    assert!(g.eval_logits(&[]).is_err());
}

#[test]
fn generation_fills_the_context_and_stops() {
    let m = model();
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let mut s = spec(0, cfg.n_layer, true, true, 1, 4);
    s.ctx_per_seq = 8;
    let mut g = Generator::new(load_stage_from_file(backend(), &m.file, s).unwrap()).unwrap();
    let mut greedy = Sampler::new(SamplingParams::greedy());
    let (out, why) = g
        .generate(&[1, 300, 17], 100, &mut greedy, &[], |_| true)
        .unwrap();
    // 3 prompt positions + 5 generated fill 8 cells; the 6th comes from the last cell's logits.
    assert_eq!((out.len(), why), (6, StopReason::ContextFull));
}

#[test]
fn prefill_logits_are_the_last_row_of_eval_logits() {
    let m = model();
    let mut g = Generator::new(whole(&m.file, 1, 4)).unwrap();
    let tokens = [1, 300, 7, 99, 41, 250, 3, 17, 5, 64];
    let all = g.eval_logits(&tokens).unwrap();
    let last = g.prefill_logits(&tokens).unwrap();
    let v = last.len();
    assert_eq!(all.len(), tokens.len() * v);
    let diff = max_rel_diff(&last, &all[(tokens.len() - 1) * v..]);
    assert!(diff < 1e-5, "relative difference {diff}");
    assert!(g.prefill_logits(&[]).is_err());
}
