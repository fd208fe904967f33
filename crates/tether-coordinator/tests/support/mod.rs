//! Shared helpers of the coordinator tests: models on disk, the single-process reference,
//! embedded workers with a coordinator over them, and reading a request's events.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tether_client::ClientOptions;
use tether_compute::CpuBackend;
use tether_coordinator::api::{FinishReason, GenError, GenEvent, GenRequest, Generation, Health};
use tether_coordinator::{Coordinator, CoordinatorConfig, ModelFile};
use tether_gguf::{GgmlType, GgufFile};
use tether_model::tokenizer::Tokenizer;
use tether_model::{Generator, Sampler, SamplingParams, SynthShape, synthesize};
use tether_worker::embedded::{LocalOptions, LocalWorkers};
use tokio::sync::mpsc;

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "tether-coord-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes the tiny synthetic llama (Q8_0) into `dir`.
pub fn tiny_model(dir: &TempDir, seed: u64) -> PathBuf {
    synth_model(dir, SynthShape::Tiny, GgmlType::Q8_0, seed)
}

/// Writes a synthetic model of `shape` and weight type `ty` into `dir`.
pub fn synth_model(dir: &TempDir, shape: SynthShape, ty: GgmlType, seed: u64) -> PathBuf {
    let path = dir.0.join(format!("{}-{ty}.gguf", shape.name()));
    synthesize(&path, shape, ty, seed).expect("synthesize");
    path
}

/// `models/stories260K.gguf` of the test data, when present and its tokenizer loads.
pub fn stories260k() -> Option<PathBuf> {
    let path = tether_test_data::stories260k()?;
    let file = GgufFile::open(&path).expect("open stories260K");
    if let Err(e) = Tokenizer::from_gguf(&file) {
        // The tokenizer is tether-model's; this test is about the pipeline.
        eprintln!(
            "note: the tokenizer cannot read {}: {e}; skipping",
            path.display()
        );
        return None;
    }
    Some(path)
}

/// Prompt token ids of `text` as the model wants them.
pub fn prompt(path: &Path, text: &str) -> Vec<u32> {
    let file = GgufFile::open(path).expect("open model");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    tok.encode(text, tok.add_bos_default(), false)
}

/// Greedy tokens of the single-process generator (the reference).
pub fn reference(path: &Path, prompt: &[u32], n: usize, ctx: usize) -> Vec<u32> {
    reference_with_cache(path, prompt, n, ctx, GgmlType::F16)
}

/// As [`reference`], with the KV cache (K and V) stored as `cache`.
pub fn reference_with_cache(
    path: &Path,
    prompt: &[u32],
    n: usize,
    ctx: usize,
    cache: GgmlType,
) -> Vec<u32> {
    reference_sampled(path, prompt, n, ctx, cache, SamplingParams::greedy())
}

/// The model's end-of-generation token ids.
pub fn end_of_generation(file: &GgufFile) -> Vec<u32> {
    let tok = Tokenizer::from_gguf(file).expect("tokenizer");
    (0..tok.vocab_size() as u32)
        .filter(|&t| tok.is_eog(t))
        .collect()
}

/// As [`reference_with_cache`], sampling with `params`.
pub fn reference_sampled(
    path: &Path,
    prompt: &[u32],
    n: usize,
    ctx: usize,
    cache: GgmlType,
    params: SamplingParams,
) -> Vec<u32> {
    let file = GgufFile::open(path).expect("open model");
    let eog = end_of_generation(&file);
    let backend = Arc::new(CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut g =
        Generator::from_file_with_cache(backend, &file, ctx, 512, cache, cache).expect("generator");
    let mut sampler = Sampler::new(params);
    let (tokens, _) = g
        .generate(prompt, n, &mut sampler, &eog, |_| true)
        .expect("generate");
    tokens
}

/// Embedded workers and a coordinator over them.
pub struct Cluster {
    pub workers: LocalWorkers,
    pub coordinator: Coordinator,
}

/// Starts `n` embedded workers (one thread each) and a coordinator over them.
pub async fn cluster(path: &Path, n: usize, tune: impl FnOnce(&mut CoordinatorConfig)) -> Cluster {
    let workers = LocalWorkers::start(
        n,
        &LocalOptions {
            threads: Some(n),
            max_memory: Some(1 << 30),
            gpus: Vec::new(),
            ..LocalOptions::default()
        },
    )
    .await
    .expect("start workers");
    let model = ModelFile::open(path).expect("open model");
    let mut config = CoordinatorConfig::new(&model, workers.addrs());
    config.client = ClientOptions::with_token(workers.token().clone());
    config.ctx_per_seq = 256;
    config.ubatch = 8;
    tune(&mut config);
    let coordinator = Coordinator::start(model, config)
        .await
        .expect("start coordinator");
    Cluster {
        workers,
        coordinator,
    }
}

/// A greedy request.
pub fn greedy(prompt: &[u32], max_tokens: usize) -> GenRequest {
    GenRequest::greedy(prompt, max_tokens)
}

/// Reads every event: the tokens, and how it ended.
pub async fn collect(
    rx: mpsc::Receiver<Result<GenEvent, GenError>>,
) -> (Vec<u32>, Result<FinishReason, GenError>) {
    collect_after(Vec::new(), rx).await
}

/// As [`collect`], for a request whose first `tokens` were read already.
pub async fn collect_after(
    mut tokens: Vec<u32>,
    mut rx: mpsc::Receiver<Result<GenEvent, GenError>>,
) -> (Vec<u32>, Result<FinishReason, GenError>) {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("an event within 60 s");
        match event {
            Some(Ok(GenEvent::Token(t))) => tokens.push(t),
            Some(Ok(GenEvent::Scored(t))) => tokens.push(t.token),
            Some(Ok(GenEvent::Prompt(_) | GenEvent::Embedding(_))) => {}
            Some(Ok(GenEvent::Done {
                finish,
                completion_tokens,
                ..
            })) => {
                assert_eq!(completion_tokens, tokens.len());
                return (tokens, Ok(finish));
            }
            Some(Err(e)) => return (tokens, Err(e)),
            None => panic!("the event stream closed without Done or an error"),
        }
    }
}

/// Submits greedy `prompt` and reads it to the end.
pub async fn generate(
    engine: &impl Generation,
    prompt: &[u32],
    max_tokens: usize,
) -> (Vec<u32>, Result<FinishReason, GenError>) {
    collect(engine.submit(greedy(prompt, max_tokens)).expect("submit")).await
}

/// Waits (up to 30 s) until `coordinator` has loaded the model again after a loss, and
/// checks that it now spans `workers` workers.
pub async fn wait_until_loaded_again(coordinator: &Coordinator, workers: usize) {
    let started = std::time::Instant::now();
    while coordinator.health() != Health::Ready {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "not loaded again: {:?}",
            coordinator.health()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let plan = coordinator.plan().expect("plan");
    assert_eq!(plan.assignments.len(), workers, "{plan}");
}
