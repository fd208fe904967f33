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
        )
        .unwrap();

    let reference_spec = StageSpec {
        first_layer: 0,
        last_layer: cfg.n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 16,
        n_seq: 2,
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
