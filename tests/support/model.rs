//! Tiny synthetic models on disk, and what the whole model generates in this process.

use std::sync::Arc;

/// A synthetic tiny model (f32; llama unless asked) in a temporary directory, removed on
/// drop.
pub struct TinyModel {
    pub dir: std::path::PathBuf,
    pub path: std::path::PathBuf,
}

impl TinyModel {
    /// Writes the model.
    pub fn new() -> TinyModel {
        Self::of(tether_model::SynthShape::Tiny)
    }

    /// Writes a tiny model of `shape` (f32).
    pub fn of(shape: tether_model::SynthShape) -> TinyModel {
        let dir = std::env::temp_dir().join(format!(
            "tether-e2e-{}-{}",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("tiny.gguf");
        tether_model::synthesize(&path, shape, tether_gguf::GgmlType::F32, 11)
            .expect("synthesize tiny model");
        TinyModel { dir, path }
    }

    /// The path as a string argument.
    pub fn arg(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }
}

impl Drop for TinyModel {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Greedy tokens of the whole model in this process, and their text as the API builds it
/// (the pieces concatenated).
pub fn reference(model: &TinyModel, prompt: &[u32], n: usize) -> (Vec<u32>, String) {
    use tether_model::tokenizer::Tokenizer;
    use tether_model::{Generator, Sampler, SamplingParams};
    let file = tether_gguf::GgufFile::open(&model.path).expect("open model");
    let tokenizer = Tokenizer::from_gguf(&file).expect("tokenizer");
    let backend = Arc::new(tether_compute::CpuBackend::new(Some(1)).expect("cpu backend"));
    let mut generator = Generator::from_file(backend, &file, 256, 8).expect("generator");
    let eog: Vec<u32> = (0..tokenizer.vocab_size() as u32)
        .filter(|&t| tokenizer.is_eog(t))
        .collect();
    let mut sampler = Sampler::new(SamplingParams {
        repeat_penalty: 1.0,
        ..SamplingParams::greedy()
    });
    let (tokens, _) = generator
        .generate(prompt, n, &mut sampler, &eog, |_| true)
        .expect("generate");
    let bytes: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| tokenizer.token_to_piece(t))
        .collect();
    (tokens, String::from_utf8_lossy(&bytes).into_owned())
}
