//! The real model behind the worker: a synthetic model loaded through Prepare's path
//! (header only, tensors streamed in chunks) computes what the model crate's own loader
//! computes, and frees everything when dropped.

use crate::model_stage::ModelStageFactory;
use crate::stage::StageFactory;
use crate::testing::TempDir;
use std::sync::Arc;
use tether_compute::CpuBackend;
use tether_gguf::{GgmlType, GgufFile};
use tether_model::{
    BatchToken, ModelConfig, StageSpec, SynthShape, load_stage_from_file, synthesize,
};
use tether_protocol::{BlockSpec, ForwardInput, ForwardOutput, Rows, TokenPos};

fn tiny_model() -> (TempDir, GgufFile, Vec<u8>) {
    let dir = TempDir::new();
    let path = dir.0.join("tiny.gguf");
    synthesize(&path, SynthShape::Tiny, GgmlType::F32, 7).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    (dir, file, bytes)
}

#[test]
fn a_block_loaded_from_header_and_chunks_matches_the_model_loader() {
    let (_dir, file, bytes) = tiny_model();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let backend = Arc::new(CpuBackend::new(Some(1)).unwrap());
    let factory = ModelStageFactory::new(Arc::clone(&backend));
    let spec = BlockSpec {
        first_layer: 0,
        last_layer: cfg.n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 16,
        n_seq: 2,
        cached_seqs: 0,
        ubatch: 4,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    };
    let header = &bytes[..file.data_offset() as usize];
    let plan = factory.plan(header, bytes.len() as u64, &spec).unwrap();
    assert!(plan.total_bytes() > 0);
    let needs = plan.tensors().to_vec();
    let mut stage = plan.build().unwrap();
    for need in &needs {
        let info = file.tensor(&need.name).unwrap();
        assert_eq!(info.bytes, need.bytes);
        for (i, chunk) in file.tensor_data(info).chunks(1000).enumerate() {
            stage
                .load_tensor(&need.name, (i * 1000) as u64, chunk)
                .unwrap();
        }
    }
    stage.finish_load().unwrap();

    let tokens = [
        TokenPos { seq: 0, pos: 0 },
        TokenPos { seq: 0, pos: 1 },
        TokenPos { seq: 1, pos: 0 },
    ];
    let ids = vec![1u32, 2, 3];
    let got = stage
        .forward(
            &tokens,
            ForwardInput::TokenIds(ids.clone()),
            &[1, 2],
            Rows::Logits,
            &[],
        )
        .unwrap();

    let reference_spec = StageSpec {
        first_layer: 0,
        last_layer: cfg.n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 16,
        n_seq: 2,
        cached_seqs: 0,
        ubatch: 4,
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    };
    let mut reference = load_stage_from_file(backend, &file, reference_spec).unwrap();
    let mut hidden = vec![0.0; ids.len() * cfg.n_embd];
    reference.embed(&ids, &mut hidden).unwrap();
    let batch: Vec<BatchToken> = tokens
        .iter()
        .map(|t| BatchToken {
            seq: t.seq,
            pos: t.pos,
        })
        .collect();
    reference.forward(&batch, &mut hidden).unwrap();
    let rows: Vec<f32> = hidden[cfg.n_embd..].to_vec();
    let mut want = vec![0.0; 2 * cfg.n_vocab];
    reference.logits(&rows, 2, &mut want).unwrap();
    assert_eq!(got, ForwardOutput::Logits(want));
    assert_eq!(stage.bytes(), reference.bytes());
}

#[test]
fn a_header_that_does_not_parse_is_an_invalid_argument() {
    let (_dir, file, bytes) = tiny_model();
    let factory = ModelStageFactory::new(Arc::new(CpuBackend::new(Some(1)).unwrap()));
    let spec = BlockSpec {
        first_layer: 0,
        last_layer: 1,
        has_embed: false,
        has_head: false,
        ctx_per_seq: 8,
        n_seq: 1,
        cached_seqs: 0,
        ubatch: 2,
        cache_k: tether_gguf::GgmlType::F16,
        cache_v: tether_gguf::GgmlType::F16,
    };
    let header = &bytes[..file.data_offset() as usize];
    let short = factory.plan(header, 100, &spec).err().unwrap();
    assert!(
        matches!(short, crate::WorkerError::InvalidArgument(_)),
        "{short:?}"
    );
    let garbage = factory.plan(b"not a gguf file", 1000, &spec).err().unwrap();
    assert!(
        matches!(garbage, crate::WorkerError::InvalidArgument(_)),
        "{garbage:?}"
    );
    let beyond = BlockSpec {
        last_layer: 99,
        ..spec
    };
    assert!(matches!(
        factory.plan(header, bytes.len() as u64, &beyond),
        Err(crate::WorkerError::InvalidArgument(_))
    ));
}

/// What log-probabilities need, reduced where the logits are (the decode step's path, on the
/// device with cuda), equals what the rows' own logits give: the f64 log-sum-exp, the
/// targets' logits, the top candidates.
#[test]
fn log_probability_rows_match_the_rows_logits() {
    let (_dir, file, bytes) = tiny_model();
    let cfg = ModelConfig::from_gguf(&file).unwrap();
    let backend = Arc::new(CpuBackend::new(Some(1)).unwrap());
    let factory = ModelStageFactory::new(backend);
    let spec = BlockSpec {
        first_layer: 0,
        last_layer: cfg.n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 16,
        n_seq: 4,
        cached_seqs: 0,
        ubatch: 4,
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    };
    let header = &bytes[..file.data_offset() as usize];
    let plan = factory.plan(header, bytes.len() as u64, &spec).unwrap();
    let needs = plan.tensors().to_vec();
    let mut stage = plan.build().unwrap();
    for need in &needs {
        let info = file.tensor(&need.name).unwrap();
        stage
            .load_tensor(&need.name, 0, file.tensor_data(info))
            .unwrap();
    }
    stage.finish_load().unwrap();
    let v = cfg.n_vocab;
    let ids = vec![1u32, 7, 3];
    let targets = [7u32, 3, (v - 1) as u32];
    let on = |seq: u32| -> Vec<TokenPos> { (0..3).map(|pos| TokenPos { seq, pos }).collect() };
    let input = || ForwardInput::TokenIds(ids.clone());
    let ForwardOutput::Logits(logits) = stage
        .forward(&on(0), input(), &[0, 1, 2], Rows::Logits, &[])
        .unwrap()
    else {
        panic!("not logits")
    };
    let rows = [0u32, 1, 2];
    let got = stage
        .forward(&on(1), input(), &rows, Rows::LogProbs(4), &targets)
        .unwrap();
    let ForwardOutput::Scored {
        counts,
        candidates,
        scores,
    } = got
    else {
        panic!("not scored: {got:?}")
    };
    assert_eq!(counts, vec![4; rows.len()]);
    for (i, &r) in rows.iter().enumerate() {
        let row = &logits[r as usize * v..(r as usize + 1) * v];
        let lse: f64 = row.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let (got_lse, got_target) = scores[i];
        assert!(
            (f64::from(got_lse) - lse).abs() < 1e-4,
            "row {r}: {got_lse} vs {lse}"
        );
        let want_target = row[targets[i] as usize];
        assert!((got_target - want_target).abs() < 1e-4, "row {r}: target");
        let mut top = Vec::new();
        tether_model::sampling::top_candidates(row, 4, &mut top);
        let got_ids: Vec<u32> = candidates[4 * i..4 * i + 4].iter().map(|c| c.0).collect();
        let want_ids: Vec<u32> = top.iter().map(|c| c.0).collect();
        assert_eq!(got_ids, want_ids, "row {r}: candidates");
        let p: f64 = candidates[4 * i..4 * i + 4]
            .iter()
            .map(|c| (f64::from(c.1) - f64::from(got_lse)).exp())
            .sum();
        assert!(p <= 1.0 + 1e-6, "row {r}: the top probabilities sum to {p}");
    }
}
