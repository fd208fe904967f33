//! A sequence's prefix copied into another sequence on the cuda backend (prefix reuse)
//! continues as its source does, and as the same copy on the cpu backend does, for every
//! KV cache type the cuda backend reads.
//!
//! Ignored by default (CI has no GPU); on a GPU machine run with `--ignored`. Without a GPU
//! the test fails: asked to check the GPU, it must not pass by skipping it.

use std::path::PathBuf;
use std::sync::Arc;

use tether_compute::{Backend, CpuBackend, CudaBackend, CudaTuning};
use tether_gguf::{GgmlType, GgufFile};
#[allow(dead_code)]
#[path = "forward/reference_model.rs"]
mod reference_model;

use tether_model::{
    BatchToken, ModelConfig, Stage, StageSpec, SynthShape, load_stage_from_file, synthesize,
};

const PREFIX: u32 = 21;
const LEN: u32 = 40;

fn at(seq: u32, positions: std::ops::Range<u32>) -> Vec<BatchToken> {
    positions.map(|pos| BatchToken { seq, pos }).collect()
}

fn stage<B: Backend>(backend: Arc<B>, file: &GgufFile, cache: GgmlType) -> Stage<B> {
    let n_layer = ModelConfig::from_gguf(file).unwrap().n_layer;
    let spec = StageSpec {
        first_layer: 0,
        last_layer: n_layer,
        has_embed: true,
        has_head: true,
        ctx_per_seq: 64,
        n_seq: 3,
        cached_seqs: 0,
        ubatch: 64,
        cache_k: cache,
        cache_v: cache,
    };
    load_stage_from_file(backend, file, spec).unwrap()
}

fn logits<B: Backend>(st: &mut Stage<B>, ids: &[u32], at: &[BatchToken]) -> Vec<f32> {
    let cfg = st.config().clone();
    let mut h = vec![0.0; ids.len() * cfg.n_embd];
    st.embed(ids, &mut h).unwrap();
    st.forward(at, &mut h).unwrap();
    let mut out = vec![0.0; ids.len() * cfg.n_vocab];
    st.logits(&h, ids.len(), &mut out).unwrap();
    out
}

/// `(logits of the source going on after PREFIX, logits of the copy going on)`.
fn copy_and_continue<B: Backend>(st: &mut Stage<B>, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let rest = &ids[PREFIX as usize..];
    logits(st, ids, &at(0, 0..LEN));
    logits(st, &ids[..9], &at(2, 0..9));
    st.kv_truncate(0, PREFIX).unwrap();
    let source = logits(st, rest, &at(0, PREFIX..LEN));
    st.kv_copy(0, 2, PREFIX).unwrap();
    let copy = logits(st, rest, &at(2, PREFIX..LEN));
    (source, copy)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_copied_prefix_continues_as_on_the_cpu() {
    let gpu = Arc::new(
        CudaBackend::with_tuning(0, &CudaTuning::from_env())
            .unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}")),
    );
    let cpu = Arc::new(CpuBackend::new(None).unwrap());
    let path: PathBuf =
        std::env::temp_dir().join(format!("tether-cuda-kv-copy-{}.gguf", std::process::id()));
    synthesize(&path, SynthShape::Tiny, GgmlType::Q8_0, 7).unwrap();
    let file = GgufFile::open(&path).unwrap();
    let n_vocab = ModelConfig::from_gguf(&file).unwrap().n_vocab as u32;
    let ids: Vec<u32> = (0..LEN).map(|i| (i * 7919 + 13) % n_vocab).collect();
    for cache in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        let (g_source, g_copy) =
            copy_and_continue(&mut stage(Arc::clone(&gpu), &file, cache), &ids);
        let (c_source, c_copy) =
            copy_and_continue(&mut stage(Arc::clone(&cpu), &file, cache), &ids);
        assert_eq!(
            c_copy, c_source,
            "{cache}: on the cpu the copy goes on as its source"
        );
        let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<_>>();
        let same = reference_model::relative_error(&g_copy, &wide(&g_source));
        assert!(same < 1e-5, "{cache}: copy vs source on the gpu: {same}");
        // The copy itself is exact (above); across backends the cache's own rounding
        // differs, most in 4-bit cells (2.4e-2 measured on an H200 with a Q4_0 cache).
        let bound = if cache == GgmlType::Q4_0 { 5e-2 } else { 2e-2 };
        let across = reference_model::relative_error(&g_copy, &wide(&c_copy));
        assert!(across < bound, "{cache}: gpu copy vs cpu copy: {across}");
    }
    let _ = std::fs::remove_file(&path);
}
