//! Gemma 2, Gemma 3 and Phi-3 stages: split by layers they decode what the whole model decodes, they
//! hold what the plan says, and Phi-3's fused tensors load from chunks in any order.

use tether_compute::CpuBackend;
use tether_gguf::GgmlType;
use tether_model::{
    BatchToken, ModelConfig, Stage, StepInput, StepOutput, SynthShape, load_stage_from_file,
    plan_stage,
};

use crate::support::{TempModel, backend, spec, synth, whole};

/// Greedy decoding of `n` tokens after `prompt` through `stages` in order (the first holds
/// the embedding, the last the head), one token a step after the prompt's prefill step.
/// Returns the tokens and the last row of logits of every step.
fn greedy_through(
    stages: &mut [Stage<CpuBackend>],
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (e, v) = (stages[0].config().n_embd, stages[0].config().n_vocab);
    let (mut out, mut rows) = (Vec::new(), Vec::new());
    let mut ids = prompt.to_vec();
    let mut pos = 0u32;
    let last = stages.len() - 1;
    for _ in 0..n {
        let toks: Vec<BatchToken> = (0..ids.len() as u32)
            .map(|i| BatchToken {
                seq: 0,
                pos: pos + i,
            })
            .collect();
        let mut h = vec![0.0; ids.len() * e];
        let mut logits = vec![0.0; ids.len() * v];
        for (i, stage) in stages.iter_mut().enumerate() {
            let input_h = h.clone();
            let input = if i == 0 {
                StepInput::Ids(&ids)
            } else {
                StepInput::Hidden(&input_h)
            };
            let output = if i == last {
                StepOutput::Logits(&mut logits)
            } else {
                StepOutput::Hidden(&mut h)
            };
            stage.decode_step(input, &toks, output).unwrap();
        }
        let row = logits[(ids.len() - 1) * v..].to_vec();
        out.push(tether_model::sampling::greedy(&row));
        rows.push(row);
        pos += ids.len() as u32;
        ids = vec![*out.last().unwrap()];
    }
    (out, rows)
}

fn split_decodes_like_whole(m: &TempModel, split: usize) {
    let n_layer = ModelConfig::from_gguf(&m.file).unwrap().n_layer;
    let prompt = [1, 300, 17, 260, 45, 299, 3, 270, 288, 100, 311, 5];
    // 12 prompt tokens and 24 more: past tiny-gemma3's window of 8 by far.
    let mut one = [whole(&m.file, 1, 16)];
    let (want, want_rows) = greedy_through(&mut one, &prompt, 24);
    let mut two = [
        load_stage_from_file(backend(), &m.file, spec(0, split, true, false, 1, 16)).unwrap(),
        load_stage_from_file(backend(), &m.file, spec(split, n_layer, false, true, 1, 16)).unwrap(),
    ];
    let (got, got_rows) = greedy_through(&mut two, &prompt, 24);
    assert_eq!(got, want);
    // Random models fall into repeating one token: the logits of every step must agree too.
    for (step, (a, b)) in got_rows.iter().zip(&want_rows).enumerate() {
        let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        let size = b.iter().fold(0f32, |m, y| m.max(y.abs()));
        assert!(diff <= 1e-5 * size, "step {step}: {diff} of {size}");
    }
}

#[test]
fn gemma3_split_by_layers_decodes_like_the_whole_model() {
    let m = synth(SynthShape::TinyGemma3, GgmlType::Q4K, 21);
    // Layers 0-2 (sliding) on one stage; 3, 4 (sliding) and 5 (global) on the other.
    split_decodes_like_whole(&m, 3);
}

#[test]
fn gemma2_split_by_layers_decodes_like_the_whole_model() {
    let m = synth(SynthShape::TinyGemma2, GgmlType::Q8_0, 26);
    split_decodes_like_whole(&m, 1);
}

#[test]
fn phi3_split_by_layers_decodes_like_the_whole_model() {
    let m = synth(SynthShape::TinyPhi3, GgmlType::Q8_0, 22);
    split_decodes_like_whole(&m, 1);
}

#[test]
fn bytes_equal_the_plan() {
    for shape in [
        SynthShape::TinyGemma3,
        SynthShape::TinyPhi3,
        SynthShape::TinyGemma2,
    ] {
        let m = synth(shape, GgmlType::Q8_0, 23);
        let cfg = ModelConfig::from_gguf(&m.file).unwrap();
        for s in [
            spec(0, cfg.n_layer, true, true, 2, 8),
            spec(1, 2, false, true, 1, 3),
        ] {
            let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
            let plan = plan_stage(&cfg, &s, &slots);
            let mut stage = load_stage_from_file(backend(), &m.file, s.clone()).unwrap();
            let allocs = stage.alloc_count();
            let mut h = vec![0.5; 7 * cfg.n_embd];
            stage
                .forward(
                    &(0..7)
                        .map(|pos| BatchToken { seq: 0, pos })
                        .collect::<Vec<_>>(),
                    &mut h,
                )
                .unwrap();
            assert_eq!(stage.bytes(), plan.total_bytes, "{} {s:?}", shape.name());
            assert_eq!(stage.alloc_count(), allocs);
        }
    }
}

/// Phi-3's `attn_qkv` and `ffn_up` are held as separate matrices: chunks that straddle the
/// boundaries between them, sent in reverse order, must land where whole tensors do.
#[test]
fn fused_tensors_load_from_chunks_in_any_order() {
    let m = synth(SynthShape::TinyPhi3, GgmlType::Q4_0, 24);
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let s = spec(0, cfg.n_layer, true, true, 1, 8);
    let ids = [1u32, 300, 17, 260];
    let toks: Vec<BatchToken> = (0..4).map(|pos| BatchToken { seq: 0, pos }).collect();
    let mut want = vec![0.0; 4 * cfg.n_vocab];
    whole(&m.file, 1, 8)
        .decode_logits(&ids, &toks, &mut want)
        .unwrap();
    let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
    let mut stage = Stage::new(backend(), cfg.clone(), s, &slots).unwrap();
    for slot in &slots {
        let data = m.file.tensor_data(m.file.tensor(&slot.name).unwrap());
        // 1000 bytes is no multiple of a Q4_0 row (18 bytes a block): chunks straddle rows
        // and the q/k/v and gate/up boundaries.
        let chunks: Vec<(usize, &[u8])> = data.chunks(1000).enumerate().collect();
        for (i, chunk) in chunks.into_iter().rev() {
            stage
                .load_tensor(&slot.name, (i * 1000) as u64, chunk)
                .unwrap();
        }
    }
    let past_end = stage.load_tensor("blk.0.attn_qkv.weight", u64::MAX - 2, &[0; 4]);
    assert!(past_end.is_err());
    stage.finish_load().unwrap();
    let mut got = vec![0.0; 4 * cfg.n_vocab];
    stage.decode_logits(&ids, &toks, &mut got).unwrap();
    assert_eq!(got, want);
}

#[test]
fn a_fused_tensor_loaded_in_part_is_named_at_finish() {
    let m = synth(SynthShape::TinyPhi3, GgmlType::F16, 25);
    let cfg = ModelConfig::from_gguf(&m.file).unwrap();
    let s = spec(0, 1, true, false, 1, 8);
    let slots = tether_model::required_tensors(&cfg, &s, m.file.tensors()).unwrap();
    let mut stage = Stage::new(backend(), cfg, s, &slots).unwrap();
    for slot in &slots {
        let data = m.file.tensor_data(m.file.tensor(&slot.name).unwrap());
        // Everything but the last byte of the fused q/k/v: the V part stays incomplete.
        let n = if slot.name == "blk.0.attn_qkv.weight" {
            data.len() - 1
        } else {
            data.len()
        };
        stage.load_tensor(&slot.name, 0, &data[..n]).unwrap();
    }
    let err = stage.finish_load().unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_qkv.weight#v"), "{err}");
}
