//! Helpers shared by the forward tests.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tether_compute::{Backend, CpuBackend};
use tether_gguf::{GgmlType, GgufFile};
use tether_model::synth::SynthType;
use tether_model::{BatchToken, Stage, StageSpec, SynthShape, load_stage_from_file, synthesize};

pub fn backend() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new(Some(2)).unwrap())
}

/// A synthesized model in a temporary file, removed on drop.
pub struct TempModel {
    pub path: PathBuf,
    pub file: GgufFile,
}

impl Drop for TempModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub fn synth(shape: SynthShape, ty: impl Into<SynthType>, seed: u64) -> TempModel {
    let ty = ty.into();
    // Tests run in parallel and may ask for the same model: each gets its own file, so one
    // test's cleanup never removes another's.
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        "tether-model-test-{}-{}-{}-{ty}-{seed}.gguf",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        shape.name()
    ));
    synthesize(&path, shape, ty, seed).unwrap();
    let file = GgufFile::open(&path).unwrap();
    TempModel { path, file }
}

pub fn spec(
    first: usize,
    last: usize,
    embed: bool,
    head: bool,
    n_seq: usize,
    ubatch: usize,
) -> StageSpec {
    StageSpec {
        first_layer: first,
        last_layer: last,
        has_embed: embed,
        has_head: head,
        ctx_per_seq: 64,
        n_seq,
        cached_seqs: 0,
        ubatch,
        cache_k: GgmlType::F16,
        cache_v: GgmlType::F16,
    }
}

pub fn whole(file: &GgufFile, n_seq: usize, ubatch: usize) -> Stage<CpuBackend> {
    let n = tether_model::ModelConfig::from_gguf(file).unwrap().n_layer;
    load_stage_from_file(backend(), file, spec(0, n, true, true, n_seq, ubatch)).unwrap()
}

/// Embeds `ids`, runs them through `stage` at `toks` and returns every row's logits.
pub fn run<B: Backend>(stage: &mut Stage<B>, ids: &[u32], toks: &[BatchToken]) -> Vec<f32> {
    let cfg = stage.config().clone();
    let mut h = vec![0.0; ids.len() * cfg.n_embd];
    stage.embed(ids, &mut h).unwrap();
    stage.forward(toks, &mut h).unwrap();
    let mut out = vec![0.0; ids.len() * cfg.n_vocab];
    stage.logits(&h, ids.len(), &mut out).unwrap();
    out
}
